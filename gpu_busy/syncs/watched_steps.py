"""A training loop's steps as the sync detector watches them: the detector's one owner.

A step's window runs from the end of the step before to the end of its own, so the
loop's work between steps counts with the step it serves; a ``WatchSchedule`` picks the
windows. The caller says where the loop is; this class enters and leaves the detector,
arms ``strict`` (never inside the callbacks' hooks) and times the windows. The rule:
docs/ARCHITECTURE.md, "Finding host-device syncs".

Example::

    steps = WatchedSteps(SyncDetector("cpu"), WatchSchedule(budget=0.01), strict=True)
    for epoch in range(epochs):
        steps.epoch_starts()
        for i, batch in enumerate(loader):
            steps.step_starts(logging=i % 50 == 0)
            train(batch)
            watched = steps.step_ends(logging=i % 50 == 0)  # (events, steady) or None
            steps.next_window()
        steps.epoch_ends()
    steps.close()
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gpu_busy.syncs.attribution import SyncEvent
from gpu_busy.syncs.detector import SyncDetector
from gpu_busy.syncs.sampling import WatchSchedule


class WatchedSteps:
    """Args:
    detector: the detector to drive (entered only inside watched windows).
    schedule: which steps to watch; fed each comparable window's time.
    strict: raise at a sync in a watched steady step or in the loop's work after one,
        never inside the callbacks' hooks (docs/ARCHITECTURE.md).
    on_open: called as each watched window opens (to tell the detector about memory
        that a step copies to the host by design).
    """

    def __init__(
        self,
        detector: SyncDetector,
        schedule: WatchSchedule,
        strict: bool = False,
        on_open: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.detector, self.schedule, self.strict = detector, schedule, strict
        self._on_open, self._clock = on_open, clock
        self.steps = 0  # windows closed in this fit: the schedule's clock, equal on all ranks
        self.watching = False  # the current window is watched
        self.after_logging = False  # the current window began right after a logging step
        self._clean = True  # no validation or epoch start inside the current window
        self._window_start: float | None = None
        self._in_step = False  # between step_starts and step_ends
        self._strict_step = False  # strict in the step itself
        self._strict_between = False  # strict in the loop's own work after the step
        self._in_hooks = 0  # callback hooks running (they nest)
        self._due = schedule.should_watch(0)

    def epoch_starts(self) -> None:
        self._close_window()  # a window open across the epoch boundary is not a step's
        self._window_start = None
        self.after_logging = False

    def batch_read(self) -> bool:
        """The DataLoader handed over a batch. At an epoch's first, its step's window opens
        here, before Lightning moves the batch (a whole-graph fit moves its one batch an
        epoch there): its copies are seen, as a later step's are. Not strict, nor a step's
        time (not clean): Lightning's epoch start is in the window. True if it opened."""
        if self._window_start is not None:
            return False
        self._window_start = self._clock()
        self._clean = False
        if self._due:
            self._open_window()
            self.detector.phase = "between steps"
            self._strict_between = False
            self._arm()
        return True

    def step_starts(self, logging: bool) -> None:
        self.batch_read()  # an epoch's first step whose read was not seen: opens here
        self.detector.phase = "training_step"
        self._in_step = True
        self._strict_step = self.strict and self._steady(logging)
        self._arm()

    def phase(self, name: str) -> None:
        self.detector.phase = name

    def step_ends(self, logging: bool) -> tuple[list[SyncEvent], bool] | None:
        """Close the step's window: when it was watched, its events (the CPU-only reads
        last, ``SyncEvent.cpu_only``) and whether the step was steady (neither a logging
        step nor right after one); else None."""
        now = self._clock()
        self._in_step = False
        watched, steady = self.watching, self._steady(logging)
        events = self._close_window() if watched else []
        if self._window_start is not None and self._clean and steady and self.steps > 0:
            self.schedule.observe(watched, now - self._window_start)  # not the first: set-up
        self.steps += 1
        self.after_logging = logging
        return (events, steady) if watched else None

    def next_window(self) -> None:
        """Open the next step's window now: it sees the loop's work after this step."""
        self._clean = True
        self._window_start = self._clock()
        self._due = self.schedule.should_watch(self.steps)
        if self._due:
            self._open_window()
            self.detector.phase = "between steps"
            # The loop's own work after this step (its prog_bar conversions, the next
            # fetch) is the step's: strict unless the step logged.
            self._strict_between = self.strict and not self.after_logging
            self._arm()

    def hooks_begin(self) -> None:
        """The callbacks' hooks for an event start: no strict in them."""
        self._in_hooks += 1
        self._arm()

    def hooks_end(self) -> None:
        self._in_hooks = max(0, self._in_hooks - 1)
        self._arm()

    def _arm(self) -> None:
        step_or_loop = self._strict_step if self._in_step else self._strict_between
        self.detector.strict = self.watching and not self._in_hooks and step_or_loop

    def pause(self) -> None:
        """Validation inside the fit: not a step."""
        if self.detector.active:
            self.detector.__exit__(None, None, None)
        self._clean = False

    def resume(self) -> None:
        if self.watching:
            self.detector.__enter__()
            self.detector.phase = "between steps"

    def epoch_ends(self) -> None:
        self._close_window()
        self._window_start = None

    def close(self) -> None:
        self._close_window()

    def _steady(self, logging: bool) -> bool:
        # The fit's first step sets up: libraries initialise on their first call (cuDNN's
        # LSTM reads back once, at its first forward, on a GPU machine) and Lightning reads
        # its first metrics. A sync that stays is met again at the next step.
        return self.steps > 0 and not (logging or self.after_logging)

    def _open_window(self) -> None:
        self._on_open()
        self.watching = True
        self.detector.take()
        self.detector.take_cpu_only()
        self.detector.__enter__()  # strict: armed by the caller's _arm, where the loop is

    def _close_window(self) -> list[SyncEvent]:
        self.watching = False
        self.detector.strict = False
        if self.detector.active:
            self.detector.__exit__(None, None, None)
        return self.detector.take() + self.detector.take_cpu_only()
