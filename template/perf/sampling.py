"""Choose which steps to watch so that an expensive probe costs a bounded share of time.

A watched step costs ``extra`` seconds more than a plain one (``plain`` seconds). Watching
one step in ``k`` costs ``extra / (k * plain)`` of the run, so ``k = ceil(extra / (budget
* plain))`` keeps it under ``budget``. Both are medians over recent steps, re-measured as
the run goes on.

The decision for a step depends only on the step number and on ``interval``, which
changes only in ``update()``: processes that call ``update()`` at the same steps with the
same figures (reduced over ranks) watch the same steps.

Example::

    schedule = WatchSchedule(budget=0.01, first=3)
    for step in range(steps):
        watched = schedule.should_watch(step)
        t0 = time.perf_counter(); run_step(watched)
        schedule.observe(watched, time.perf_counter() - t0)
        if step % 20 == 19:
            schedule.update(*schedule.estimate())
"""

from __future__ import annotations

import math
import statistics
from collections import deque


class WatchSchedule:
    """Watch the first ``first`` steps, then one in ``interval`` steps (set from measurement).

    Args:
        budget: largest share of run time the watching may cost (0.01 = 1%).
        first: steps always watched at the start (the first of them is never timed: it
            includes one-off set-up).
        window: how many recent samples the medians use.
        max_interval: never watch less often than this.
    """

    def __init__(
        self, budget: float = 0.01, first: int = 3, window: int = 64, max_interval: int = 500
    ) -> None:
        if not 0 < budget <= 1:
            raise ValueError(f"budget must be in (0, 1], got {budget}")
        self.budget = budget
        self.first = first
        self.max_interval = max_interval
        self.interval: int | None = None  # None: not measured yet, watch only the first steps
        self.watched: deque[float] = deque(maxlen=window)
        self.plain: deque[float] = deque(maxlen=window)
        self._last_watched = -1

    def should_watch(self, step: int) -> bool:
        watch = step < self.first or (
            self.interval is not None and step - self._last_watched >= self.interval
        )
        if watch:
            self._last_watched = step
        return watch

    def observe(self, watched: bool, seconds: float) -> None:
        """Time of one comparable step (leave out steps with validation, logging, set-up)."""
        (self.watched if watched else self.plain).append(seconds)

    def estimate(self) -> tuple[float | None, float | None]:
        """(median watched step, median plain step) in seconds; None where not sampled."""
        w = statistics.median(self.watched) if self.watched else None
        p = statistics.median(self.plain) if self.plain else None
        return w, p

    def update(self, watched_s: float | None, plain_s: float | None) -> None:
        """Set ``interval`` from (watched, plain) step times, reduced over ranks if several."""
        if watched_s is None or plain_s is None or plain_s <= 0:
            if self.interval is None and watched_s is None:
                self.interval = self.max_interval  # nothing measured: watch rarely to learn
            return
        extra = max(0.0, watched_s - plain_s)
        # At least 2, so that plain steps keep coming to measure against.
        k = math.ceil(extra / (self.budget * plain_s)) if extra > 0 else 2
        self.interval = max(2, min(self.max_interval, k))

    @staticmethod
    def overhead(watched_s: float | None, plain_s: float | None) -> float | None:
        """Extra time of a watched step as a fraction of a plain one."""
        if watched_s is None or not plain_s:
            return None
        return max(0.0, watched_s - plain_s) / plain_s
