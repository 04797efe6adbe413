"""When the host started each CUDA sync, from CUDA's own sync debug mode, at no cost per step.

With ``torch.cuda.set_sync_debug_mode("warn")`` PyTorch warns just before every
synchronizing CUDA call (``.item()``, ``.cpu()``, ``nonzero``, stream and device
synchronize); a step without syncs pays nothing. ``SyncMarks`` turns those warnings into
host timestamps, which ``StepTimer`` uses to tell a sync stall from other idle, and
swallows them (nothing is printed). It leaves a mode the user chose alone ("error" stays
"error"), and restores everything on ``close()``.

Example::

    marks = SyncMarks().open()        # CUDA only; a no-op elsewhere
    loss.item()
    marks.since(t0)                   # [perf_counter() when the .item() began]
    marks.close()
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import deque

import torch

# The text of PyTorch's warning (c10/cuda/CUDAFunctions.cpp, warn_or_error_on_sync).
CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"


class SyncMarks:
    """Host timestamps of the last ``keep`` CUDA syncs, from the thread that opened it."""

    def __init__(self, keep: int = 4096) -> None:
        self._times: deque[float] = deque(maxlen=keep)
        self._catch: warnings.catch_warnings | None = None
        self._mode_before: int | None = None
        self._thread = threading.get_ident()
        self.count = 0

    @property
    def active(self) -> bool:
        return self._catch is not None

    def open(self) -> SyncMarks:
        if self.active or not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return self
        self._thread = threading.get_ident()
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        # "always": Python would otherwise report a code location's warning only once.
        warnings.filterwarnings("always", message=CUDA_SYNC_WARNING)
        show = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if CUDA_SYNC_WARNING not in str(message):
                return show(message, category, filename, lineno, file, line)
            if threading.get_ident() == self._thread:
                self._times.append(time.perf_counter())
                self.count += 1
            return None

        showwarning.records_cuda_syncs = True  # the sync detector passes its warnings on
        warnings.showwarning = showwarning
        self._mode_before = torch.cuda.get_sync_debug_mode()
        if self._mode_before == 0:
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def since(self, t: float) -> list[float]:
        """The marks at or after ``t``, oldest first (read from the newest end)."""
        out = []
        for x in reversed(self._times):
            if x < t:
                break
            out.append(x)
        return out[::-1]

    def close(self) -> None:
        if self._catch is None:
            return
        if self._mode_before == 0 and torch.cuda.get_sync_debug_mode() == 1:
            torch.cuda.set_sync_debug_mode(0)
        self._catch.__exit__(None, None, None)
        self._catch = None
