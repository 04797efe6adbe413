"""Hear about every CUDA sync: PyTorch's sync debug mode, and the explicit ``synchronize()``
calls it does not report, printing nothing.

``cuda_sync_warnings(on_sync)`` arms ``torch.cuda.set_sync_debug_mode("warn")`` (leaving a
mode the user set alone), calls ``on_sync()`` for each warning heard on the entering
thread, and swallows it; a warning is heard when the outermost Python binding around the
op returns. ``synchronize_calls_heard(on_call)`` hears each explicit ``synchronize()`` as
it starts. Any number of listeners, opening and closing in any order, share one hook and
one wrapper per entry point. ``DEBUG_MODE`` is the switch and the text listened for
(tests stand a CPU warning in, tests/helpers/cuda_standin.py). Sources:
docs/ARCHITECTURE.md, "CUDA assumptions".

Example::

    with cuda_sync_warnings(lambda: print("sync")):
        loss.item()          # prints "sync" when item() returns
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gpu_busy.patches import patch

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

        stack.callback(patch(warnings, "showwarning", showwarning))
        users_mode = mode.get()
        if users_mode == 0:
            mode.set("warn")
            stack.callback(_disarm, mode)
            stack.callback(_barriers_unarmed(mode, users_mode))
        return stack


def _disarm(mode: SyncDebugMode) -> None:
    if mode.get() == 1:
        mode.set(0)


def _barriers_unarmed(mode: SyncDebugMode, users_mode: int) -> Callable[[], None]:
    """``torch.distributed.barrier`` runs under the user's mode while the listener holds
    "warn": under NCCL it ends in ``Work.wait``'s stream synchronize, whose warning no
    Python handler buffers (c10d ``init.cpp`` binds it without one) and so goes to stderr,
    on every rank. Returns the undo."""
    dist = torch.distributed
    if not (dist.is_available() and hasattr(dist, "barrier")):
        return lambda: None
    original = dist.barrier

    def barrier(*args: Any, **kwargs: Any) -> Any:
        armed = mode.get()
        mode.set(users_mode)
        try:
            return original(*args, **kwargs)
        finally:
            mode.set(armed)

    barrier.__wrapped__ = original
    return patch(dist, "barrier", barrier)


def synchronize_calls() -> list[tuple[Any, str, str, str | None, bool]]:
    """The explicit ``synchronize()`` entry points: ``(owner, name, label, device type (None:
    any), whether the sync debug mode reports it too)``. ``torch.cuda.synchronize()``,
    ``Event.synchronize()`` and ``torch.accelerator.synchronize()`` never consult the mode
    (``c10/cuda/CUDAFunctions.cpp``, ``CUDAEvent.h``); ``Stream.synchronize()`` goes
    through c10's ``stream_synchronize``, which does."""
    out: list[tuple[Any, str, str, str | None, bool]] = [
        (torch.cuda, "synchronize", "torch.cuda.synchronize()", "cuda", False),
        (torch.cuda.Stream, "synchronize", "Stream.synchronize()", "cuda", True),
        (torch.cuda.Event, "synchronize", "Event.synchronize()", "cuda", False),
    ]
    if hasattr(torch, "cpu") and hasattr(torch.cpu, "synchronize"):
        out.append((torch.cpu, "synchronize", "torch.cpu.synchronize()", "cpu", False))
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        out.append((accelerator, "synchronize", "torch.accelerator.synchronize()", None, False))
    return out


# What a synchronize() listener is called with: (label, device type, reported by the debug
# mode too); it may return what to call with the host times the call began and returned.
OnSynchronize = Callable[[str, "str | None", bool], "Callable[[float, float], None] | None"]


@contextlib.contextmanager
def synchronize_calls_heard(on_call: OnSynchronize) -> Iterator[None]:
    """While inside, every call of an entry point of ``synchronize_calls()``, on any thread,
    first calls ``on_call``. The first listener to open wraps them, the last to close puts
    them back: the idle monitor's marks and the sync detector's windows overlap without
    nesting, and two wrappers stacked would be undone out of order."""
    with _Synchronize.lock:
        if not _Synchronize.listeners:
            _Synchronize.undo = [
                patch(owner, name, _heard(getattr(owner, name), label, device, reported))
                for owner, name, label, device, reported in synchronize_calls()
            ]
        _Synchronize.listeners.append(on_call)
    try:
        yield
    finally:
        with _Synchronize.lock:
            _Synchronize.listeners.remove(on_call)
            if not _Synchronize.listeners:
                for undo in reversed(_Synchronize.undo):
                    undo()
                _Synchronize.undo = []


class _Synchronize:
    lock = threading.Lock()
    listeners: list[OnSynchronize] = []
    undo: list[Callable[[], None]] = []


def _heard(original: Callable, label: str, device: str | None, reported: bool) -> Callable:
    def synchronize(*args: Any, **kwargs: Any) -> Any:
        after = [
            a for on_call in list(_Synchronize.listeners) if (a := on_call(label, device, reported))
        ]
        began = time.perf_counter()  # after every listener's own work
        try:
            return original(*args, **kwargs)
        finally:
            returned = time.perf_counter()
            for each in after:
                each(began, returned)

    synchronize.__wrapped__ = original
    return synchronize
