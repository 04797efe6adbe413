"""Hear about every CUDA sync from PyTorch's own sync debug mode, printing nothing.

With ``torch.cuda.set_sync_debug_mode("warn")`` PyTorch warns just before each call that
makes the host wait for the GPU (``.item()``, ``.cpu()``, ``nonzero``, stream and device
synchronize); calls that do not synchronize never consult the mode, so a sync-free step
pays nothing. ``cuda_sync_warnings(on_sync)`` arms that mode (leaving a mode the user set,
such as "error", alone), calls ``on_sync()`` for each such warning raised on the thread
that entered it, and swallows the warning. Nested listeners all hear each sync: the sync
detector inside the idle monitor's marks, for instance.

Example::

    with cuda_sync_warnings(lambda: print("sync")):
        loss.item()          # prints "sync"
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator

import torch

# The text of PyTorch's warning (c10/cuda/CUDAFunctions.cpp, warn_or_error_on_sync).
CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"


@contextlib.contextmanager
def cuda_sync_warnings(on_sync: Callable[[], None]) -> Iterator[None]:
    thread = threading.get_ident()
    mode_before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        # "always": Python would otherwise report a code location's warning only once.
        warnings.filterwarnings("always", message=CUDA_SYNC_WARNING)
        outer = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if CUDA_SYNC_WARNING not in str(message):
                return outer(message, category, filename, lineno, file, line)
            if threading.get_ident() == thread:
                on_sync()
            if getattr(outer, "hears_cuda_syncs", False):
                outer(message, category, filename, lineno, file, line)
            return None

        showwarning.hears_cuda_syncs = True
        warnings.showwarning = showwarning
        if mode_before == 0:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            if mode_before == 0 and torch.cuda.get_sync_debug_mode() == 1:
                torch.cuda.set_sync_debug_mode(0)
