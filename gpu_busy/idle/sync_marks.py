"""When the host started each CUDA sync, from CUDA's own sync debug mode, at no cost per step.

A sync inside an op is marked when its warning arrives (the op's end); an explicit
``synchronize()`` the mode does not report, as it starts (``synchronize_calls_heard``).
``StepTimer`` reads the marks to tell a sync stall from other idle. Details:
docs/ARCHITECTURE.md, "Idle time".

Example::

    marks = SyncMarks().open()        # CUDA only; a no-op elsewhere
    loss.item()
    marks.since(t0)                   # [perf_counter() when the .item() began]
    marks.close()
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque

from gpu_busy.cuda_sync_warnings import cuda_sync_warnings, debug_mode, synchronize_calls_heard


class SyncMarks:
    """Host timestamps of the last ``keep`` CUDA syncs started on the thread that opened it."""

    def __init__(self, keep: int = 4096) -> None:
        self._times: deque[float] = deque(maxlen=keep)
        self._stack: contextlib.ExitStack | None = None
        self._thread: int | None = None

    @property
    def active(self) -> bool:
        return self._stack is not None

    def open(self) -> SyncMarks:
        if self.active or not debug_mode().ready():
            return self
        self._thread = threading.get_ident()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(cuda_sync_warnings(self._mark))
        self._stack.enter_context(synchronize_calls_heard(self._synchronize_starts))
        return self

    def _synchronize_starts(self, label: str, device: str | None, reported: bool) -> None:
        # One the debug mode reports (Stream.synchronize()) is marked by its warning.
        if not reported and device in ("cuda", None) and threading.get_ident() == self._thread:
            self._mark()

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
