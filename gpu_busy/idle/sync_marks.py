"""When the host started each CUDA sync, from CUDA's own sync debug mode, at no cost per step.

A sync inside an op is marked when its warning arrives (the op's end); the explicit
``synchronize()`` entry points, which never consult the mode, are wrapped while open and
marked at their start. ``StepTimer`` reads the marks to tell a sync stall from other idle.
Details: docs/ARCHITECTURE.md, "Idle time".

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
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gpu_busy.cuda_sync_warnings import cuda_sync_warnings, debug_mode


class SyncMarks:
    """Host timestamps of the last ``keep`` CUDA syncs started on the thread that opened it."""

    def __init__(self, keep: int = 4096) -> None:
        self._times: deque[float] = deque(maxlen=keep)
        self._stack: contextlib.ExitStack | None = None

    @property
    def active(self) -> bool:
        return self._stack is not None

    def open(self) -> SyncMarks:
        if self.active or not debug_mode().ready():
            return self
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(cuda_sync_warnings(self._mark))
        thread = threading.get_ident()
        for owner, name in _explicit_synchronize():
            self._stack.enter_context(_wrapped(owner, name, self._mark_on(thread)))
        return self

    def _mark_on(self, thread: int):
        def mark() -> None:
            if self._stack is not None and threading.get_ident() == thread:
                self._mark()

        return mark

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


def _explicit_synchronize() -> list[tuple[Any, str]]:
    # Stream.synchronize() is not here: it goes through c10's stream_synchronize, which
    # consults the debug mode (a second mark would count the sync twice).
    out = [(torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize")]
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        out.append((accelerator, "synchronize"))
    return out


@contextlib.contextmanager
def _wrapped(owner: Any, name: str, before: Callable[[], None]) -> Iterator[None]:
    """``owner.name`` calls ``before()`` first while inside; restored after, unless someone
    wrapped it again meanwhile (then ours stays below theirs, marking nothing once closed)."""
    original = getattr(owner, name)

    def synchronize(*args: Any, **kwargs: Any) -> Any:
        before()
        return original(*args, **kwargs)

    synchronize.__wrapped__ = original
    setattr(owner, name, synchronize)
    try:
        yield
    finally:
        if getattr(owner, name) is synchronize:
            setattr(owner, name, original)
