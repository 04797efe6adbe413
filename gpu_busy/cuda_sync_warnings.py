"""Hear about every CUDA sync from PyTorch's own sync debug mode, printing nothing.

``cuda_sync_warnings(on_sync)`` arms ``torch.cuda.set_sync_debug_mode("warn")`` (leaving a
mode the user set alone), calls ``on_sync()`` for each warning heard on the entering
thread, and swallows it; nested listeners all hear each sync. A warning is heard when the
outermost Python binding around the op returns. ``DEBUG_MODE`` is the switch and the text
listened for (tests stand a CPU warning in, tests/helpers/cuda_standin.py). Sources:
docs/ARCHITECTURE.md, "CUDA assumptions".

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
