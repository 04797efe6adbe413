"""How long the GPU sat idle, and why: always-on step timing and exact profiler windows.

- ``StepTimer`` / ``TimedReads``: per-step device time, idle gap and its causes from CUDA
  events read back with ``query()`` (host clocks on other devices);
- ``analyze_trace``: span, busy and idle time from a profiler trace, per step, with NCCL
  apart and gaps classified (HTA's host-wait definition);
- ``ProfilerWindows``: profiler windows now and then, saved and analysed;
- ``IdleStats`` / ``StepSeries``: window sums that ranks can reduce, and a per-step series;
- ``causes``: the table of idle causes everything above reads, and ``split_gap``.

Example::

    from gpu_busy.idle import analyze_trace
    print(analyze_trace("trace.json").idle_ms)
"""

from gpu_busy.idle.profiler_windows import ProfilerUnavailable, ProfilerWindows
from gpu_busy.idle.stats import IdleStats, StepSeries
from gpu_busy.idle.step_timer import StepTimer, StepTiming, TimedReads
from gpu_busy.idle.sync_marks import SyncMarks
from gpu_busy.idle.trace import StepIdle, TraceIdle, analyze_trace

__all__ = [
    "IdleStats",
    "ProfilerUnavailable",
    "ProfilerWindows",
    "StepIdle",
    "StepSeries",
    "StepTimer",
    "StepTiming",
    "SyncMarks",
    "TimedReads",
    "TraceIdle",
    "analyze_trace",
]
