"""Choose which steps to watch so that an expensive probe costs a bounded share of time.

Step ``n``, after ``w`` watched, is watched only if ``(w + 1) * extra <= budget * (n + 1)``,
``extra`` being a watched step's extra cost; ranks that ``update()`` with the same reduced
figures watch the same steps. Details: docs/ARCHITECTURE.md, "Finding host-device syncs".

Example::

    schedule = WatchSchedule(budget=0.01, first=3)
    for step in range(steps):
        watched = schedule.should_watch(step)
        t0 = time.perf_counter(); run_step(watched)
        schedule.observe(watched, time.perf_counter() - t0)
        if step % 20 == 19:
            schedule.update(*schedule.estimate())       # (reduced over ranks, under DDP)
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from gpu_busy.window_sums import WindowSums


@dataclass
class WatchedSums(WindowSums):
    """Watched steps and the syncs in them, all and steady (neither a logging step nor
    right after one)."""

    watched: int = 0
    syncs: int = 0
    steady_watched: int = 0
    steady_syncs: int = 0


class WatchSchedule:
    """Watch the first ``first`` steps, then as often as the budget allows (from measurement).

    ``plan_fit(steps)`` at the start of a fit of known length lowers ``first`` so that the
    always-watched steps fit the budget of the whole fit, by the prior cost below. When
    that leaves one, it is the second step, not the first: a step is watched from the end
    of the one before, so only from the second on does a window hold everything a steady
    step does (the loop's work between steps: Lightning converts ``prog_bar`` metrics
    there).

    Args:
        budget: largest share of run time the watching may cost (0.01 = 1%).
        first: steps always watched at the start (the first of them is never timed: it
            includes one-off set-up).
        window: how many recent samples the medians use.
        max_interval: until a cost is measured, watch one step in this many (to measure).
    """

    def __init__(
        self, budget: float = 0.01, first: int = 3, window: int = 64, max_interval: int = 500
    ) -> None:
        if not 0 < budget <= 1:
            raise ValueError(f"budget must be in (0, 1], got {budget}")
        self.budget = budget
        self.first = self.first_asked = first
        self.first_at = 0  # the always-watched steps are first_at .. first_at + first - 1
        self.max_interval = max_interval
        self.interval: int | None = None  # steady-state spacing; None: not measured yet
        self.extra: float | None = None  # cost of a watched step, in plain steps
        self.watched_batches = 0
        self.watched: deque[float] = deque(maxlen=window)
        self.plain: deque[float] = deque(maxlen=window)
        self._last_watched = -1

    # What a watched step costs before one is measured, in plain steps: what it cost on a
    # GPU machine, where a watched step is dearest (the default fit: +164%, bench.syncs:
    # +130%; docs/BENCHMARKS.md), rounded up. A CPU's (+34% to +45%) would let a short GPU
    # fit watch three steps and go over the budget.
    PRIOR_EXTRA = 1.75

    def plan_fit(self, steps: float | None) -> bool:
        """Fit the always-watched first steps into the budget of a fit of ``steps`` (None or
        inf: unknown, keep ``first``). At least one is watched; returns False when even that
        one is over the budget (a fit shorter than ``PRIOR_EXTRA / budget`` steps)."""
        self.first, self.first_at = self.first_asked, 0
        if steps is None or math.isinf(steps) or steps <= 0:
            return True
        affordable = int(self.budget * steps / self.PRIOR_EXTRA)
        self.first = max(1, min(self.first_asked, affordable))
        if self.first == 1 and steps >= 2:
            self.first_at = 1
        return affordable >= 1

    def should_watch(self, step: int) -> bool:
        if step < self.first_at + self.first:
            watch = step >= self.first_at
        elif self.extra is None:
            watch = self.interval is not None and step - self._last_watched >= self.interval
        else:
            # At least 2 apart, so that plain steps keep coming to measure against.
            affordable = (self.watched_batches + 1) * self.extra <= self.budget * (step + 1)
            watch = affordable and step - self._last_watched >= 2
        if watch:
            self._last_watched = step
            self.watched_batches += 1
        return watch

    def observe(self, watched: bool, seconds: float) -> None:
        """Time of one comparable step (leave out steps with validation, logging, set-up)."""
        (self.watched if watched else self.plain).append(seconds)

    def estimate(self) -> tuple[float | None, float | None, float | None]:
        """(median watched step, median plain step, the plain steps' upper quartile) in
        seconds; None where not sampled."""
        w = statistics.median(self.watched) if self.watched else None
        p = statistics.median(self.plain) if self.plain else None
        high = _upper_quartile(self.plain) if self.plain else None
        return w, p, high

    def update(
        self, watched_s: float | None, plain_s: float | None, plain_high_s: float | None = None
    ) -> None:
        """Set the cost from (watched, plain) step times, reduced over ranks if several. A
        watched step no slower than the plain steps' upper quartile (``plain_high_s``; the
        median where not given) is within their own spread: a loaded machine hides its
        cost there, and a watched step is never free, so the cost known stays."""
        if watched_s is None or plain_s is None or plain_s <= 0:
            if self.interval is None and watched_s is None:
                self.interval = self.max_interval  # nothing measured: watch rarely to learn
            return
        if watched_s <= max(plain_s, plain_high_s or 0.0):
            if self.interval is None:
                self.interval = self.max_interval
            return
        self.extra = self.overhead(watched_s, plain_s)
        self.interval = max(2, math.ceil(self.extra / self.budget))

    @staticmethod
    def overhead(watched_s: float | None, plain_s: float | None) -> float | None:
        """Extra time of a watched step as a fraction of a plain one."""
        if watched_s is None or not plain_s:
            return None
        return max(0.0, watched_s - plain_s) / plain_s

    @classmethod
    def costliest(
        cls, ranks: list[tuple[float, float, float]]
    ) -> tuple[float | None, float | None, float | None]:
        """The (watched, plain, plain upper quartile) step seconds of the rank where watching
        costs most, from every rank's ``estimate()`` (NaN for None, as gathered): every rank
        watched the same steps, so the costliest sets the schedule."""
        both = [(w, p, h) for w, p, h in ranks if w == w and p == p and p > 0]  # NaN != NaN
        if both:
            return max(both, key=lambda wph: cls.overhead(*wph[:2]))
        watched = [w for w, _, _ in ranks if w == w]
        return (max(watched) if watched else None), None, None


def _upper_quartile(samples) -> float:
    ordered = sorted(samples)
    return ordered[(3 * (len(ordered) - 1)) // 4]
