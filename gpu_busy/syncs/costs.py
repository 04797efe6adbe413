"""What each sync cost: how long the host sat in it, and how long the GPU then stood idle.

``SyncTimeline`` is told, on one host clock, when each sync began and returned, when the
next op that launches device work was dispatched, and the measuring code's own time;
``host_ms`` is the call, ``idle_after_ms`` the idle it left until the next launch (None:
not measured). GPU time only on a GPU; the CPU simulation's reports read n/a.

Example::

    timeline = SyncTimeline()
    timeline.began(0, at=1.000)    # event 0, an .item(), called
    timeline.returned(at=1.004)    # the host waited 4 ms for the queue to drain
    timeline.own(1.004, 1.0042)    # the detector's bookkeeping after it
    timeline.launch(at=1.0050)     # the next kernel launched
    timeline.costs[0]              # SyncCost(host_ms=4.0, idle_after_ms=0.8)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SyncCost:
    host_ms: float | None = None
    idle_after_ms: float | None = None


class SyncTimeline:
    """The costs of the syncs of one watched window, by event index."""

    def __init__(self) -> None:
        self.costs: dict[int, SyncCost] = {}
        self._calling: tuple[int, float] | None = None  # (event, began at)
        self._idle_event = 0
        # When the open idle began (a sync returned), None when there is none: a plain
        # attribute, read on every op of a watched step.
        self.idle_since: float | None = None
        self._own_s = 0.0  # the measuring code's time since the idle began

    def began(self, event: int, at: float) -> None:
        self._end_idle(at)  # the next sync owns the idle from here on
        self._calling = (event, at)
        self.costs[event] = SyncCost()

    def returned(self, at: float) -> None:
        if self._calling is None:
            return
        event, began = self._calling
        self._calling = None
        self.costs[event].host_ms = 1e3 * max(0.0, at - began)
        self._idle_event, self.idle_since, self._own_s = event, at, 0.0

    def own(self, start: float, end: float) -> None:
        """The measuring code ran from ``start`` to ``end``: what of it falls in an open idle
        is not the sync's cost. Intervals are given once each, in any order of nesting, and
        never overlap."""
        if self.idle_since is not None:
            self._own_s += max(0.0, end - max(start, self.idle_since))

    def launch(self, at: float) -> None:
        """An op that puts work on the device was dispatched at ``at``."""
        self._end_idle(at)

    def close(self) -> None:
        """The watched window ends: an idle still open was not seen to end (None)."""
        self._calling = self.idle_since = None

    def take(self) -> dict[int, SyncCost]:
        out, self.costs = self.costs, {}
        self.close()
        return out

    def _end_idle(self, at: float) -> None:
        since = self.idle_since
        if since is None:
            return
        self.idle_since = None
        self.costs[self._idle_event].idle_after_ms = 1e3 * max(0.0, at - since - self._own_s)
