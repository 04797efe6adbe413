"""Peak device memory per training step, from the caching allocator's host-side counters.

Each step starts with ``reset_peak_memory_stats`` and ends with a read of the allocator's
statistics; neither calls into the device (docs/ARCHITECTURE.md, "CUDA assumptions").
Reserved far above allocated is fragmentation. Off CUDA: no figures. The reset is the
allocator's own, so anyone else's ``max_memory_allocated()`` reads one step's peak.

Example::

    memory = MemoryPeaks(torch.device("cuda"))
    memory.step_started()
    train_step(batch)
    memory.step_ended()
    memory.window.allocated_max, memory.total.reserved_max    # bytes
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpu_busy.cuda_runtime import runtime

GIB = 2**30


@dataclass
class MemoryStats:
    steps: int = 0
    allocated_max: float = 0.0  # bytes: the highest step peak
    reserved_max: float = 0.0
    allocated_sum: float = 0.0  # of the steps' peaks, for their mean

    def add(self, other: MemoryStats) -> None:
        self.steps += other.steps
        self.allocated_max = max(self.allocated_max, other.allocated_max)
        self.reserved_max = max(self.reserved_max, other.reserved_max)
        self.allocated_sum += other.allocated_sum

    def take(self) -> MemoryStats:
        out = MemoryStats(self.steps, self.allocated_max, self.reserved_max, self.allocated_sum)
        self.steps, self.allocated_max, self.reserved_max, self.allocated_sum = 0, 0.0, 0.0, 0.0
        return out

    def as_list(self) -> list[float]:
        return [self.steps, self.allocated_max, self.reserved_max, self.allocated_sum]

    def gib(self) -> dict[str, float | None]:
        """The peaks in GiB; None without a measured step."""
        n = self.steps
        return {
            "peak_allocated_gib": self.allocated_max / GIB if n else None,
            "peak_reserved_gib": self.reserved_max / GIB if n else None,
            "step_peak_allocated_gib": self.allocated_sum / n / GIB if n else None,
        }


class MemoryPeaks:
    """Per-step peaks on ``device``; on anything but CUDA it measures nothing.

    Args:
        read: the allocator's peak allocated and reserved bytes, or None before any
            allocation (by default ``runtime().memory_peaks``); tests script it.
        reset: sets the peaks back to the current values (``reset_memory_peaks``).
    """

    def __init__(
        self,
        device: torch.device | str,
        read: Callable[[Any], tuple[int, int] | None] | None = None,
        reset: Callable[[Any], None] | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.on = runtime().takes_route(self.device)
        self._read = read or (lambda device: runtime().memory_peaks(device))
        self._reset = reset or (lambda device: runtime().reset_memory_peaks(device))
        self.window = MemoryStats()  # since the last logging step
        self.total = MemoryStats()  # the fit

    def step_started(self) -> None:
        if self.on:
            self._reset(self.device)

    def step_ended(self) -> None:
        if not self.on:
            return
        peaks = self._read(self.device)
        if peaks is None:  # CUDA not initialised: nothing was allocated
            return
        allocated, reserved = peaks
        w = self.window
        w.steps += 1
        w.allocated_max = max(w.allocated_max, allocated)
        w.reserved_max = max(w.reserved_max, reserved)
        w.allocated_sum += allocated

    def take_window(self) -> MemoryStats:
        window = self.window.take()
        self.total.add(window)
        return window


def expandable_segments_on() -> bool:
    """Whether the allocator was configured with ``expandable_segments:True``."""
    names = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the second: its device-neutral name
    conf = ",".join(os.environ.get(name, "") for name in names)
    return "expandable_segments:true" in conf.replace(" ", "").lower()
