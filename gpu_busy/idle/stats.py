"""Sums of step timings over a window of steps, and a bounded per-step series for plots.

``IdleStats`` is a flat list of numbers that ranks all-gather and add; ``means()`` gives
per-step figures (``loader_wait_ms``: the host's wait for the DataLoader; ``idle_<cause>_ms``:
GPU idle by cause). ``StepSeries`` keeps at most ``capacity`` rows, thinning as it fills.

Example::

    window = IdleStats()
    for timing in timer.poll():
        window.add_step(timing)
    window.means(cuda=True)   # {"idle_pct": 3.1, "idle_ms": 0.4, "idle_data_wait_ms": ...}
"""

from __future__ import annotations

from dataclasses import dataclass

import gpu_busy.idle.causes as cause_table
from gpu_busy.idle.step_timer import StepTiming
from gpu_busy.window_sums import WindowSums


@dataclass
class IdleStats(WindowSums):
    steps: int = 0  # steps read back
    host_ms: float = 0.0
    host_backward_ms: float = 0.0
    loader_wait_ms: float = 0.0  # the host's wait for the DataLoader
    timed_steps: int = 0  # steps with device figures and a step boundary before them
    device_ms: float = 0.0
    transfer_ms: float = 0.0
    copy_ms: float = 0.0  # the part of transfer_ms the host's time does not explain
    idle_ms: float = 0.0
    idle_data_wait_ms: float = 0.0  # idle while the host waited for the DataLoader
    idle_sync_stall_ms: float = 0.0
    idle_launch_bound_ms: float = 0.0
    idle_other_ms: float = 0.0
    syncs: int = 0

    def add_step(self, t: StepTiming) -> None:
        self.steps += 1
        self.host_ms += t.host_ms
        self.host_backward_ms += t.host_backward_ms
        self.loader_wait_ms += t.loader_wait_ms
        self.syncs += t.syncs
        if t.idle_ms is None or t.device_ms is None:
            return
        self.timed_steps += 1
        self.device_ms += t.device_ms
        self.transfer_ms += t.transfer_ms or 0.0
        self.copy_ms += t.copy_ms or 0.0
        self.idle_ms += t.idle_ms
        for cause, name in _FIELDS:
            setattr(self, name, getattr(self, name) + (t.causes.get(cause) or 0.0))

    def means(self, cuda: bool) -> dict[str, float | None]:
        """Per-step figures (ms) and the idle share of device wall time (%); None = n/a."""
        n, m = self.steps, self.timed_steps
        wall = self.idle_ms + self.transfer_ms + self.device_ms
        out: dict[str, float | None] = {
            "idle_pct": _per(100.0 * self.idle_ms, wall if m else 0),
            "step_ms": _per(wall, m),  # idle + transfer + the step: the period
            "idle_ms": _per(self.idle_ms, m),
            "device_ms": _per(self.device_ms, m),
            "transfer_ms": _per(self.transfer_ms, m),
            # the host's work in the transfer: its hooks before the step (on a host clock
            # all of it: no copy to wait for)
            "transfer_host_ms": _per(max(0.0, self.transfer_ms - self.copy_ms), m),
            # only a GPU queue tells a copy from the host's hooks
            "copy_ms": _per(self.copy_ms, m if cuda else 0),
            "host_step_ms": _per(self.host_ms, n),
            "host_backward_ms": _per(self.host_backward_ms, n),
            "loader_wait_ms": _per(self.loader_wait_ms, n),
        }
        for cause in cause_table.TABLE:
            # what only a GPU queue tells is None on a host clock, not a guess
            known = cuda or cause.on_host_clock
            out[cause.key] = _per(getattr(self, cause.key), m if known else 0)
        out["cuda_syncs_per_batch"] = _per(self.syncs, n if cuda else 0)
        return out


def _per(total: float, count: float) -> float | None:
    """``total / count``; None (n/a) where there is nothing to divide by."""
    return total / count if count > 0 else None


_FIELDS = tuple((cause.name, cause.key) for cause in cause_table.TABLE)


class StepSeries:
    """Per-step rows for the report's picture, at most ``capacity`` of them."""

    COLUMNS = (
        "step",
        "loader_wait_ms",
        "transfer_ms",
        "device_ms",
        *(c.key for c in cause_table.TABLE),
    )

    def __init__(self, capacity: int = 2048) -> None:
        self.capacity = capacity
        self.rows: list[list[float]] = []
        self.stride = 1
        self._seen = 0

    def add(self, t: StepTiming) -> None:
        seen, self._seen = self._seen, self._seen + 1
        if seen % self.stride or t.idle_ms is None or t.device_ms is None:
            return
        causes = [t.causes.get(c) or 0.0 for c in cause_table.names()]
        self.rows.append(
            [float(t.step), t.loader_wait_ms, t.transfer_ms or 0.0, t.device_ms, *causes]
        )
        if len(self.rows) >= self.capacity:
            self.rows = self.rows[::2]
            self.stride *= 2
