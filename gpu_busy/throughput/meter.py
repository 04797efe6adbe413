"""Samples per second from the device's own clock, read back without a sync.

Lightning's ``ThroughputMonitor`` calls ``torch.cuda.synchronize()`` at every batch so
that the host's clock tells when the device finished. Here the device tells it: a CUDA
event is recorded on the compute stream at a step's end, another some steps later, and the
time between them is read with ``elapsed_time`` once ``query()`` says both completed. A
span runs from one step's end to a later step's end, so each step in it brings one whole
period (the gap before it, its transfer, the step) and the samples of its own batch. A gap
that is not between two steps (validation, an epoch's end) ends the span; the next opens at
the next step's end. Off CUDA a host clock stands in (complete as soon as recorded).

Example::

    meter = StepSpans(torch.device("cuda"))
    for batch in loader:
        train_step(batch)
        meter.step_ended(samples=len(batch))
        if logging_step:
            meter.cut()                  # ends a segment here; the span goes on
    meter.break_span()                   # validation next: not a step's gap
    meter.poll()                         # the segments whose events completed, into .done
    meter.done.samples / (meter.done.device_ms / 1e3)    # samples/s
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from gpu_busy.event_pool import EventPool, HostEventPool
from gpu_busy.window_sums import WindowSums


@dataclass
class ThroughputStats(WindowSums):
    steps: int = 0  # steps with a whole period in a timed span
    device_ms: float = 0.0  # the spans' time on the device clock
    samples: int = 0
    tokens: int = 0
    unsized_steps: int = 0  # steps whose batch had no size Lightning could find
    untokened_steps: int = 0  # steps whose batch did not say how many tokens it held
    untimed_steps: int = 0  # steps lost because the event pool ran dry

    def rates(self) -> dict[str, float | None]:
        """samples/s, tokens/s and steps/s over the timed spans; None where unknown."""
        seconds = self.device_ms / 1e3
        if not self.steps or seconds <= 0:
            return {"samples_per_s": None, "tokens_per_s": None, "steps_per_s": None}
        return {
            "samples_per_s": None if self.unsized_steps else self.samples / seconds,
            "tokens_per_s": None if self.untokened_steps else self.tokens / seconds,
            "steps_per_s": self.steps / seconds,
        }


class StepSpans:
    """Times spans of consecutive training steps on ``device``'s compute stream.

    Args:
        device: CUDA gets events; anything else host clocks.
        pool: where events come from (``acquire``/``release``); by default an
            ``EventPool`` on CUDA and host-clock stand-ins elsewhere.
    """

    def __init__(self, device: torch.device | str, pool: Any = None) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.clock = "cuda events" if self.is_cuda else "host clock"
        self._pool = pool or (EventPool(capacity=16) if self.is_cuda else HostEventPool())
        self._open: Any = None  # the event the current segment started at
        self._segment = ThroughputStats()
        self._pending: deque[tuple[Any, Any, ThroughputStats]] = deque()
        self.done = ThroughputStats()  # segments read back, not yet taken

    def step_ended(self, samples: int | None, tokens: int | None = None) -> None:
        """At a step's end; ``samples`` / ``tokens`` None where the batch does not say."""
        if self._open is None:
            self._open = self._record()  # this step's gap held a break: it starts the span
            return
        s = self._segment
        s.steps += 1
        s.samples += samples or 0
        s.unsized_steps += samples is None
        s.tokens += tokens or 0
        s.untokened_steps += tokens is None

    def cut(self) -> None:
        """Ends the segment at the last step's end; the next one starts there."""
        if self._open is None or not self._segment.steps:
            return
        end, again = self._record(), self._record()
        if end is None or again is None:  # no events left: keep counting into this one
            self._pool.release(*(e for e in (end, again) if e is not None))
            return
        self._pending.append((self._open, end, self._segment.take()))
        self._open = again

    def break_span(self) -> None:
        """The coming gap is not between two steps: end the span at the last step's end."""
        self.cut()
        if self._segment.steps:  # could not be cut: its steps go untimed
            self.done.untimed_steps += self._segment.take().steps
        if self._open is not None:
            self._pool.release(self._open)
        self._open = None

    def poll(self, block: bool = False) -> None:
        """Reads back the segments whose events completed (all of them with ``block``, at
        the end of training, where waiting costs nothing)."""
        while self._pending:
            start, end, stats = self._pending[0]
            if block:
                end.synchronize()
            elif not end.query():
                return
            self._pending.popleft()
            stats.device_ms = start.elapsed_time(end)
            self.done.add(stats)
            self._pool.release(start, end)

    def close(self) -> None:
        """The end of training: every span ended and read back."""
        self.break_span()
        self.poll(block=True)

    def _record(self) -> Any:
        event = self._pool.acquire()
        if event is not None:
            event.record(torch.cuda.current_stream(self.device) if self.is_cuda else None)
        return event
