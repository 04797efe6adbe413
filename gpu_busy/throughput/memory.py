"""Peak device memory per logging window, from the caching allocator's host-side counters.

A window starts with ``reset_peak_memory_stats`` and ends with one read of the allocator's
peaks; validation inside a window is left out (read before it, reset after). Neither call
reaches the device, and neither happens in a steady step (docs/ARCHITECTURE.md, "CUDA calls
per step"). Reserved far above allocated is fragmentation. Off CUDA: no figures. The reset
is the allocator's own, so anyone else's ``max_memory_allocated()`` reads the window's peak.

Example::

    memory = MemoryPeaks(torch.device("cuda"))
    memory.start()                  # the fit's first window
    for _ in range(20): train_step(next(batches))
    memory.take_window().allocated_max, memory.total.reserved_max    # bytes
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from gpu_busy.cuda_runtime import runtime
from gpu_busy.window_sums import WindowSums, largest

GIB = 2**30


@dataclass
class MemoryStats(WindowSums):
    windows: int = 0  # windows read
    allocated_max: float = largest()  # bytes: the highest window peak
    reserved_max: float = largest()

    def gib(self) -> dict[str, float | None]:
        """The peaks in GiB; None without a window read."""
        n = self.windows
        return {
            "peak_allocated_gib": self.allocated_max / GIB if n else None,
            "peak_reserved_gib": self.reserved_max / GIB if n else None,
        }


class MemoryPeaks:
    """The peaks of each window on ``device``; on anything but CUDA it measures nothing.
    The allocator is asked through ``cuda_runtime.runtime()`` (tests put a scripted one)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.on = runtime().takes_route(self.device)
        self.window = MemoryStats()  # since the last logging step
        self.total = MemoryStats()  # the fit
        self._open = False

    def start(self) -> None:
        """Training steps follow: the peaks count from here."""
        if self.on and not self._open:
            runtime().reset_memory_peaks(self.device)
            self._open = True

    def pause(self) -> None:
        """What follows is no training step (validation): the peaks so far join the window."""
        if not self._open:
            return
        self._open = False
        peaks = runtime().memory_peaks(self.device)
        if peaks is None:  # CUDA not initialised: nothing was allocated
            return
        w = self.window
        w.windows = 1
        w.allocated_max = max(w.allocated_max, peaks[0])
        w.reserved_max = max(w.reserved_max, peaks[1])

    def take_window(self) -> MemoryStats:
        """The window's peaks (at a logging step); the next window starts."""
        if was_open := self._open:
            self.pause()
        window = self.window.take()
        self.total.add(window)
        if was_open:
            self.start()
        return window


def expandable_segments_on() -> bool:
    """Whether the allocator was configured with ``expandable_segments:True``."""
    names = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the second: its device-neutral name
    conf = ",".join(os.environ.get(name, "") for name in names)
    return "expandable_segments:true" in conf.replace(" ", "").lower()
