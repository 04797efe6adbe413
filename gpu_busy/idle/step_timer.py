"""Per-step GPU idle time from CUDA events on the compute stream, read without a sync.

Five marks a step, ``end(N-1) → hooks_done(N-1) → ready(N) → start(N) → end(N)``, give
the work enqueued after a step, the idle gap, the transfer and the step's device time;
``idle.causes`` splits the gap. Events come from a bounded pool and are read with
``query()``; off CUDA host clocks stand in and the GPU-only figures are None. The marks,
the ``d - h`` rule and the blind spots: docs/ARCHITECTURE.md, "Idle time".

Example::

    timer = StepTimer(torch.device("cuda"))
    for batch in TimedReads(loader, timer):   # times each DataLoader read, marks ready
        timer.start_step()
        train_step(batch)
        timer.end_step()
        for t in timer.poll():                # the steps whose events have completed
            print(t.step, t.idle_ms, t.causes)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_busy.cuda_runtime import runtime
from gpu_busy.event_pool import EventPool, HostEventPool
from gpu_busy.idle.causes import names, split_gap
from gpu_busy.idle.intervals import Interval, overlap_length
from gpu_busy.idle.sync_marks import SyncMarks


@dataclass(slots=True)
class StepTiming:
    """One training step. Times in ms; None where the clock cannot tell."""

    step: int
    host_ms: float  # host wall time from the step's start to its end
    loader_wait_ms: float  # the host's wait for the DataLoader in the gap before the step
    device_ms: float | None  # the step on the compute stream
    transfer_ms: float | None  # ready -> start on the compute stream: the copy and the hooks
    idle_ms: float | None  # None: the gap before was not a step boundary (epoch start...)
    causes: dict[str, float | None] = field(default_factory=dict)
    syncs: int = 0  # syncs the host started from the previous step's start to this one's
    # host time in backward(): under DDP on gloo it holds the wait for slower ranks
    host_backward_ms: float = 0.0
    # the part of transfer_ms that the host's own time between ready and start does not
    # explain: the batch's copy (or the wait for a side-stream copy) holding the step back
    copy_ms: float | None = None
    samples: int | None = None  # the batch's size and tokens, where the caller said them
    tokens: int | None = None

    @property
    def period_ms(self) -> float | None:
        """The previous step's end to this one's: one whole period of the loop."""
        if self.idle_ms is None or self.device_ms is None:
            return None
        return self.idle_ms + (self.transfer_ms or 0.0) + self.device_ms


@dataclass(slots=True)
class _Step:
    step: int
    prev_end: Any  # the previous step's end event; None when the gap is not a boundary
    hooks_done: Any  # after every callback's on_train_batch_end of the previous step
    ready: Any
    start: Any
    end: Any = None
    h_prev_start: float = 0.0
    h_prev_end: float = 0.0
    h_hooks_done: float = 0.0
    h_ready: float | None = None
    h_start: float = 0.0
    h_end: float = 0.0
    h_backward: float = 0.0  # seconds in backward()
    h_backward_from: float | None = None
    waits: list[Interval] = field(default_factory=list)
    syncs: list[float] = field(default_factory=list)
    samples: int | None = None
    tokens: int | None = None
    lane: int = 0

    @property
    def marks(self) -> tuple:
        """Its events, the end first: the last recorded, so the one most often pending."""
        return (self.end, self.prev_end, self.hooks_done, self.ready, self.start)


class StepTimer:
    """Times training steps and the idle gaps between them on ``device``'s compute stream.

    Args:
        device: the device the steps run on; CUDA gets events, anything else host clocks.
        capacity: the most CUDA events held at once (4 per step in flight).
        sync_marks: where the host's syncs are seen (``SyncMarks``); None: not attributed.
        tolerance_ms: how close two host/device instants must be to count as the same
            (event launch latency and clock reads).
        pool: where events come from (``acquire``/``release``); by default an
            ``EventPool(capacity)`` on CUDA and host-clock stand-ins elsewhere.
    """

    def __init__(
        self,
        device: torch.device | str,
        capacity: int = 256,
        sync_marks: SyncMarks | None = None,
        tolerance_ms: float = 0.1,
        pool: Any = None,
    ) -> None:
        device = torch.device(device)
        self.is_cuda = runtime().takes_route(device)
        self.device = device
        self.clock = "cuda events" if self.is_cuda else "host clock"
        if pool is None:
            pool = EventPool(capacity) if self.is_cuda else HostEventPool()
        self._pool = pool
        # Asked of CUDA once, not at every mark: again at each read-back (refresh_stream)
        self._stream = runtime().current_stream(device) if self.is_cuda else None
        self._lane = 0  # how many times the stream changed: marks on one lane complete in order
        self.sync_marks = sync_marks if self.is_cuda else None
        self._tolerance_s = tolerance_ms / 1e3
        self._refs: dict[Any, int] = {}
        self._pending: deque[_Step] = deque()
        self._current: _Step | None = None
        self._steps = 0
        self.untimed = 0  # steps without device figures because the pool ran dry
        # the gap being measured
        self._last_end: Any = None
        self._h_last_end = 0.0
        self._h_last_start = 0.0
        self._gap_ready: Any = None
        self._h_ready: float | None = None
        self._gap_hooks_done: Any = None
        self._h_hooks_done = 0.0
        self._gap_waits: list[Interval] = []

    @property
    def steps_started(self) -> int:
        """Steps started so far: also the number the next ``start_step`` gives (from 0)."""
        return self._steps

    # -- marks, in step order ---------------------------------------------------------

    def hooks_done(self) -> None:
        """Every callback's ``on_train_batch_end`` has run: what they enqueued since
        ``end_step`` is device work, not idle."""
        if self._last_end is None or self._gap_hooks_done is not None:
            return
        self._gap_hooks_done = self._record()
        self._h_hooks_done = time.perf_counter()

    def loader_wait(self, start_s: float, end_s: float) -> None:
        """The host waited for the DataLoader from ``start_s`` to ``end_s`` (perf_counter)."""
        self._gap_waits.append((start_s, end_s))
        ready = self._record()
        self._drop(self._gap_ready)  # only the last read before the step counts
        self._gap_ready, self._h_ready = ready, time.perf_counter()

    def start_step(self) -> None:
        if self._current is not None:  # a step that never ended (an exception, a skip)
            self._discard(self._current)
        start = self._record()
        h_start = time.perf_counter()
        marks = self.sync_marks.since(self._h_last_start) if self.sync_marks else []
        self._current = _Step(
            step=self._steps,
            prev_end=self._last_end,  # the reference moves to this step
            hooks_done=self._gap_hooks_done,
            ready=self._gap_ready,
            start=start,
            h_prev_start=self._h_last_start,
            h_prev_end=self._h_last_end,
            h_hooks_done=self._h_hooks_done,
            h_ready=self._h_ready,
            h_start=h_start,
            waits=self._gap_waits,
            syncs=marks,
            lane=self._lane,
        )
        self._last_end, self._gap_ready, self._h_ready, self._gap_waits = None, None, None, []
        self._gap_hooks_done = None
        self._h_last_start = h_start
        self._steps += 1

    def backward_begins(self) -> None:
        if self._current is not None:
            self._current.h_backward_from = time.perf_counter()

    def backward_ended(self) -> None:
        step = self._current
        if step is not None and step.h_backward_from is not None:
            step.h_backward += time.perf_counter() - step.h_backward_from
            step.h_backward_from = None

    def end_step(self) -> None:
        step = self._current
        if step is None:
            return
        self._current = None
        step.end = self._record()
        step.h_end = time.perf_counter()
        self._hold(step.end)  # once for this step, once for the next step's gap
        self._last_end, self._h_last_end = step.end, step.h_end
        self._pending.append(step)

    def count_last(self, samples: int | None, tokens: int | None = None) -> None:
        """The step ``end_step`` just ended held ``samples`` and ``tokens`` (None: unknown)."""
        if self._pending and self._pending[-1].end is self._last_end is not None:
            self._pending[-1].samples, self._pending[-1].tokens = samples, tokens

    def break_gap(self) -> None:
        """What follows is not a step boundary (validation, an epoch's end): no idle figure
        for the next step's gap."""
        self._drop(self._last_end)
        self._drop(self._gap_ready)
        self._drop(self._gap_hooks_done)
        self._last_end, self._gap_ready, self._h_ready, self._gap_waits = None, None, None, []
        self._gap_hooks_done = None

    # -- read-back --------------------------------------------------------------------

    def poll(self, block: bool = False) -> list[StepTiming]:
        """The steps whose events have all completed, oldest first.

        Every mark goes to one stream, where events complete in the order recorded: the
        newest step whose end has completed tells that every older mark has too, so a read
        queries one or two events, not five a step. Call it once per logging window, not
        per step. ``block=True`` waits for the rest: only where waiting costs nothing (run end).
        """
        if block:
            for step in self._pending:
                for e in step.marks:
                    if e is not None:
                        e.synchronize()
        done = []
        for _ in range(len(self._pending) if block else self._completed()):
            step = self._pending.popleft()
            done.append(self._resolve(step))
            self._discard(step)
        return done

    def refresh_stream(self) -> None:
        """Ask CUDA for the current stream again (at a read-back): a user who switched the
        fit to a stream of their own is followed from here; the gap across is not timed."""
        if not self.is_cuda:
            return
        stream = runtime().current_stream(self.device)
        if stream != self._stream:
            self._stream, self._lane = stream, self._lane + 1
            self.break_gap()

    def _completed(self) -> int:
        """How many of the oldest pending steps have completed every mark."""
        pending, k = self._pending, 0
        # steps of an earlier stream: no order with the current one, each asked in full
        while k < len(pending) and pending[k].lane != self._lane:
            if not all(e is None or e.query() for e in pending[k].marks):
                return k
            k += 1
        for i in range(len(pending) - 1, k - 1, -1):
            end = pending[i].end  # None: the pool ran dry at that step; an older one tells
            if end is not None and end.query():
                return i + 1
        return k

    def close(self) -> list[StepTiming]:
        """Read back every ended step (blocking) and give all events back."""
        done = self.poll(block=True)
        if self._current is not None:
            self._discard(self._current)
            self._current = None
        self.break_gap()
        return done

    # -- internals --------------------------------------------------------------------

    def _record(self) -> Any:
        event = self._pool.acquire()
        if event is not None:
            event.record(self._stream)
            self._hold(event)
        return event

    def _hold(self, event: Any) -> None:
        if event is not None:
            self._refs[event] = self._refs.get(event, 0) + 1

    def _drop(self, event: Any) -> None:
        if event is None:
            return
        left = self._refs.get(event, 0) - 1
        if left > 0:
            self._refs[event] = left
        else:
            self._refs.pop(event, None)
            self._pool.release(event)

    def _discard(self, step: _Step) -> None:
        for e in step.marks:
            self._drop(e)

    def _resolve(self, step: _Step) -> StepTiming:
        waits_ms = 1e3 * sum(e - s for s, e in step.waits)
        device = transfer = copy = idle = None
        if step.start is not None and step.end is not None:
            device = step.start.elapsed_time(step.end)
        else:
            self.untimed += 1
        if step.prev_end is not None and step.start is not None:
            if step.ready is not None:
                idle = max(0.0, step.prev_end.elapsed_time(step.ready))
                transfer = max(0.0, step.ready.elapsed_time(step.start))
                if self.is_cuda:
                    copy = self._unexplained(transfer, step.h_start - step.h_ready)
            else:
                idle = max(0.0, step.prev_end.elapsed_time(step.start))
            if step.hooks_done is not None and self.is_cuda:
                # The previous step's callbacks' kernels: device time, not idle.
                after = step.prev_end.elapsed_time(step.hooks_done)
                work = min(idle, self._unexplained(after, step.h_hooks_done - step.h_prev_end))
                idle -= work
                if device is not None:
                    device += work
        idle_end = step.h_ready if step.ready is not None else step.h_start
        return StepTiming(
            step=step.step,
            host_ms=1e3 * (step.h_end - step.h_start),
            loader_wait_ms=waits_ms,
            device_ms=device,
            transfer_ms=transfer,
            copy_ms=copy,
            idle_ms=idle,
            causes=self._attribute(step, idle, idle_end),
            syncs=len(step.syncs),
            host_backward_ms=1e3 * step.h_backward,
            samples=step.samples,
            tokens=step.tokens,
        )

    def _unexplained(self, device_ms: float, host_s: float) -> float:
        """The part of a device interval that the host's time over it does not explain: work
        the device did while the host had already moved on (within the tolerance: none)."""
        excess = device_ms - 1e3 * host_s
        return excess if excess > 1e3 * self._tolerance_s else 0.0

    def _attribute(
        self, step: _Step, idle_ms: float | None, idle_end: float | None
    ) -> dict[str, float | None]:
        if idle_ms is None or idle_end is None:
            return dict.fromkeys(names())
        drained = idle_end - idle_ms / 1e3  # when the GPU ran out of work, host clock
        data = {"data_wait": 1e3 * overlap_length((drained, idle_end), step.waits)}
        if not self.is_cuda:
            # No queue on the host: nothing to drain, nothing to stall on.
            return split_gap(idle_ms, data, None)
        tol = self._tolerance_s
        ran_dry_in_step = drained <= step.h_prev_end + tol
        sync_in_gap = any(step.h_prev_end <= t <= drained + tol for t in step.syncs)
        sync_in_step = any(step.h_prev_start <= t <= step.h_prev_end for t in step.syncs)
        holds = {
            "sync_stall": sync_in_gap or (ran_dry_in_step and sync_in_step),
            "launch_bound": ran_dry_in_step,
        }
        return split_gap(idle_ms, data, holds)


class TimedReads(Iterator):
    """Yields ``source``'s items and tells ``timer`` how long the host waited for each."""

    def __init__(self, source: Iterable, timer: StepTimer) -> None:
        self._source = iter(source)
        self._timer = timer

    def __next__(self) -> Any:
        t0 = _now()
        try:
            item = next(self._source)
        finally:
            # The read that ends the epoch is a wait for the DataLoader too (its shutdown):
            # before the last step, Lightning's one-ahead fetch makes only that read.
            self._timer.loader_wait(t0, _now())
        return item


def _now() -> float:
    """``time.perf_counter()``; a clock a test mocked with too few values raises
    StopIteration, which from a read would end every epoch at once (a fit bounded by
    max_steps alone then runs empty epochs for ever): an error instead."""
    try:
        return time.perf_counter()
    except StopIteration:
        raise RuntimeError("gpu_busy: time.perf_counter() raised StopIteration") from None
