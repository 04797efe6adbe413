"""When the host started each CUDA sync, from CUDA's own sync debug mode, at no cost per step.

PyTorch's sync debug mode warns just before every synchronizing CUDA call (``.item()``,
``.cpu()``, ``nonzero``, stream and device synchronize); a step without syncs pays
nothing. ``SyncMarks`` keeps the host time of each (``gpu_busy.cuda_sync_warnings``),
which ``StepTimer`` uses to tell a sync stall from other idle. Nothing is printed; a
mode the user chose ("error") is left alone; ``close()`` restores everything.

Example::

    marks = SyncMarks().open()        # CUDA only; a no-op elsewhere
    loss.item()
    marks.since(t0)                   # [perf_counter() when the .item() began]
    marks.close()
"""

from __future__ import annotations

import contextlib
import time
from collections import deque

import torch

from gpu_busy.cuda_sync_warnings import cuda_sync_warnings


class SyncMarks:
    """Host timestamps of the last ``keep`` CUDA syncs started on the thread that opened it."""

    def __init__(self, keep: int = 4096) -> None:
        self._times: deque[float] = deque(maxlen=keep)
        self._stack: contextlib.ExitStack | None = None

    @property
    def active(self) -> bool:
        return self._stack is not None

    def open(self) -> SyncMarks:
        if self.active or not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return self
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(cuda_sync_warnings(self._mark))
        return self

    def _mark(self) -> None:
        self._times.append(time.perf_counter())

    def since(self, t: float) -> list[float]:
        """The marks at or after ``t``, oldest first (read from the newest end)."""
        out = []
        for x in reversed(self._times):
            if x < t:
                break
            out.append(x)
        return out[::-1]

    def close(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
