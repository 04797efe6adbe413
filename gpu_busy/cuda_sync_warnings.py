"""Hear about every CUDA sync from PyTorch's own sync debug mode, printing nothing.

With ``torch.cuda.set_sync_debug_mode("warn")`` PyTorch raises a C++ warning inside each
call that makes the host wait for the GPU (``.item()``, ``.cpu()``, ``nonzero``,
``Stream.synchronize()``); calls that do not synchronize never consult the mode, so a
sync-free step pays nothing. ``cuda_sync_warnings(on_sync)`` arms that mode (leaving a
mode the user set, such as "error", alone), calls ``on_sync()`` for each such warning
heard on the thread that entered it, and swallows the warning. Nested listeners all hear
each sync: the sync detector inside the idle monitor's marks, for instance.

When a warning is heard: a C++ warning is buffered by the nearest Python binding's
warning handler and issued when that binding returns (``torch/csrc/Exceptions.cpp``,
``PyWarningHandler``), so ``on_sync`` runs after the op has finished, when the outermost
Python call around it returns; for syncs in ``backward()``, when ``backward()`` returns.
Calls bound without a handler (c10d's ``Work.wait``) send it to stderr instead: while it
armed the mode, the listener gives ``torch.distributed.barrier`` the user's own mode, so
a checkpoint's barrier under NCCL prints nothing (and is not heard).

``DEBUG_MODE`` is the switch and the text listened for; tests replace it with a CPU
stand-in that raises a C++ warning from inside a CPU kernel (tests/helpers/cuda_standin.py).

Example::

    with cuda_sync_warnings(lambda: print("sync")):
        loss.item()          # prints "sync" when item() returns
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

# The text of PyTorch's warning (c10/cuda/CUDAFunctions.cpp, warn_or_error_on_sync).
CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"


@dataclass(frozen=True)
class SyncDebugMode:
    """A device type's sync debug mode: the text of its warning and its switch."""

    device_type: str
    message: str
    ready: Callable[[], bool]  # the mode can be armed now (the device is initialised)
    get: Callable[[], int]  # 0 off, 1 "warn", 2 "error"
    set: Callable[[int | str], None]

    def serves(self, device_type: str) -> bool:
        """Whether this mode hears the syncs of ``device_type``'s tensors now."""
        return device_type == self.device_type and self.ready()


def _set_cuda_mode(mode: int | str) -> None:
    with warnings.catch_warnings():
        # PyTorch warns once per process, at the first arming, that the mode is a prototype
        # (a TORCH_WARN_ONCE in its binding): a note for whoever arms it by hand, printed into
        # a user's output that never asked for it. What the mode misses is ours to say, in
        # docs/ARCHITECTURE.md ("Finding host-device syncs").
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        torch.cuda.set_sync_debug_mode(mode)


CUDA = SyncDebugMode(
    "cuda",
    CUDA_SYNC_WARNING,
    ready=lambda: torch.cuda.is_available() and torch.cuda.is_initialized(),
    get=lambda: torch.cuda.get_sync_debug_mode(),
    set=_set_cuda_mode,
)
DEBUG_MODE = CUDA  # read at each entry: a test may put a stand-in here


def debug_mode() -> SyncDebugMode:
    return DEBUG_MODE


@contextlib.contextmanager
def cuda_sync_warnings(on_sync: Callable[[], None]) -> Iterator[None]:
    """Call ``on_sync()`` for each sync warning heard on this thread while inside.

    Listeners may open and close in any order (the idle monitor's marks and the sync
    detector's windows overlap without nesting): the first to open arms the mode and
    installs one warning hook for all, the last to close restores both."""
    listener = (threading.get_ident(), on_sync)
    _Hook.add(listener)
    try:
        yield
    finally:
        _Hook.remove(listener)


class _Hook:
    """The one ``warnings.showwarning`` hook and armed mode shared by all listeners."""

    _lock = threading.Lock()
    _listeners: list[tuple[int, Callable[[], None]]] = []
    _stack: contextlib.ExitStack | None = None
    _mode: SyncDebugMode | None = None

    @classmethod
    def add(cls, listener: tuple[int, Callable[[], None]]) -> None:
        with cls._lock:
            if not cls._listeners:
                cls._stack = cls._install(DEBUG_MODE)
            cls._listeners.append(listener)

    @classmethod
    def remove(cls, listener: tuple[int, Callable[[], None]]) -> None:
        with cls._lock:
            cls._listeners.remove(listener)
            stack = cls._stack if not cls._listeners else None
            if stack is not None:
                cls._stack = None
        if stack is not None:
            stack.close()

    @classmethod
    def _install(cls, mode: SyncDebugMode) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(warnings.catch_warnings())
        # "always": Python would otherwise report a code location's warning only once.
        warnings.filterwarnings("always", message=mode.message)
        outer = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if mode.message not in str(message):
                return outer(message, category, filename, lineno, file, line)
            me = threading.get_ident()
            for thread, on_sync in list(cls._listeners):
                if thread == me:
                    on_sync()
            return None

        warnings.showwarning = showwarning
        users_mode = mode.get()
        if users_mode == 0:
            mode.set("warn")
            stack.callback(_disarm, mode)
            stack.enter_context(_barriers_unarmed(mode, users_mode))
        return stack


def _disarm(mode: SyncDebugMode) -> None:
    if mode.get() == 1:
        mode.set(0)


@contextlib.contextmanager
def _barriers_unarmed(mode: SyncDebugMode, users_mode: int) -> Iterator[None]:
    """``torch.distributed.barrier`` runs under the user's mode while the listener holds
    "warn": under NCCL it ends in ``Work.wait``'s stream synchronize, whose warning no
    Python handler buffers (c10d ``init.cpp`` binds it without one) and so goes to stderr,
    on every rank."""
    dist = torch.distributed
    if not (dist.is_available() and hasattr(dist, "barrier")):
        yield
        return
    original = dist.barrier

    def barrier(*args: Any, **kwargs: Any) -> Any:
        armed = mode.get()
        mode.set(users_mode)
        try:
            return original(*args, **kwargs)
        finally:
            mode.set(armed)

    barrier.__wrapped__ = original
    dist.barrier = barrier
    try:
        yield
    finally:
        if dist.barrier is barrier:
            dist.barrier = original
