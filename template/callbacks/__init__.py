"""Lightning callbacks: thin adapters over the mechanisms in ``template.perf`` and
``template.faults``."""

from template.callbacks.idle_time_monitor import IdleTimeMonitor
from template.callbacks.nonfinite_loss import StopOnNonFiniteLoss
from template.callbacks.progress_bar import LoggingStepProgressBar
from template.callbacks.rank_failure import StopOnRankFailure
from template.callbacks.rng_state import CheckpointRngState
from template.callbacks.run_summary import RunSummary
from template.callbacks.stop_on_signal import StopOnSignal
from template.callbacks.stream_prefetcher import StreamPrefetcher
from template.callbacks.sync_point_detector import SyncPointDetector

__all__ = [
    "CheckpointRngState",
    "IdleTimeMonitor",
    "LoggingStepProgressBar",
    "RunSummary",
    "StopOnNonFiniteLoss",
    "StopOnRankFailure",
    "StopOnSignal",
    "StreamPrefetcher",
    "SyncPointDetector",
]
