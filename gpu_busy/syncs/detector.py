"""Find every operation that makes the host wait for the device, and name the line.

``detect_syncs`` records each sync while active, with the innermost frame of *your* code,
the library chain below it and the phase, from three layers (``syncs.layers``) and, on
CUDA, its sync debug mode. With ``device_type="cpu"`` CPU tensors count as device memory,
so CI without a GPU finds the same lines. It costs a Python call per aten op: watch a
sample of steps. Details: docs/ARCHITECTURE.md, "Finding host-device syncs".

Example::

    with detect_syncs(device_type="cuda") as rec:
        loss = model(x).loss
        print(f"loss {loss.item():.3f}")          # a sync
    for e in rec.events:
        print(e)        # "Tensor.item() at train.py:42 in step: print(f'loss {loss...'"

    assert_no_syncs(training_step, batch, device_type="cpu")   # in CI, no GPU needed
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from gpu_busy.cuda_sync_warnings import cuda_sync_warnings, debug_mode
from gpu_busy.syncs.attribution import ALLOWED, SyncError, SyncEvent, event_here, fix_for
from gpu_busy.syncs.costs import SyncTimeline
from gpu_busy.syncs.device_branches import device_branch
from gpu_busy.syncs.layers import (
    NO_KERNEL,
    DispatchLayer,
    FunctionLayer,
    optimizer_step_hooks,
    synchronize_layer,
)
from gpu_busy.syncs.memory import HostMemory, excused, tensors_of

T = TypeVar("T")


class SyncDetector:
    """Records host-device syncs while entered; re-enterable (events accumulate).

    Use ``detect_syncs(...)`` to make one. ``phase`` labels events outside backward (the
    Lightning callback sets it per hook); ``strict`` raises ``SyncError`` at the first
    sync, before the op runs, so the traceback ends at the offending line.

    ``origins``: for a sync a library makes with no user frame inside its training loop,
    functions that may name the user line it stands for: each gets a library frame of the
    sync's stack and returns ``(filename, lineno, function)``, with the frame that asked for
    the read as a fourth item where it knows one, or None (Lightning's conversion of a
    ``prog_bar=True`` metric stands for the ``self.log`` line: ``lightning_compat.LoggedAt``).
    ``chain_hints``: ``(function, fix)`` pairs; a sync with that function in its library
    chain gets that fix, in the strict error and the report alike (``fix_for``).
    """

    def __init__(
        self,
        device_type: str = "cuda",
        strict: bool = False,
        cuda_debug: bool = True,
        origins: tuple[Callable[[Any], tuple | None], ...] = (),
        chain_hints: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.memory = HostMemory(device_type)  # which tensors are device memory
        self.origins = origins
        self.chain_hints = chain_hints
        self.strict = strict
        self.cuda_debug = cuda_debug
        self.phase = "forward"
        self.events: list[SyncEvent] = []
        # Reads the CPU simulation sees that a GPU would not make (syncs.device_branches):
        # listed, never counted, never strict's.
        self.cpu_only: list[SyncEvent] = []
        self.internal_errors = 0  # failures of the detector's own code, kept from the program
        self.inside = 0  # >0 while a recorded op runs: what it calls is not counted again
        # strict's error was raised: what runs after it (the error's handling) is not the
        # program's, and is not recorded until the detector is entered again
        self.stopped = False
        self._ops: list[Any] = []  # ops in flight: their str() names CUDA's warnings
        self.tracks_ops = False  # ops are named for CUDA's warnings (its debug mode is on)
        # CUDA's warnings come late (see _cuda_debug_warnings): the calls the layers are
        # running on the entering thread, the events recorded since the outermost began,
        # whether a warning was heard in it, and the recorded calls whose warnings are
        # still to come from a binding around them that the layers do not see.
        self._depth = 0
        self._call_events = 0
        self._heard_in_call = False
        self._owed = 0
        self.thread: int | None = None  # the entering thread: where the layers' calls count
        self._stack: contextlib.ExitStack | None = None
        self.timeline = SyncTimeline()  # what each event cost, by its index in events
        self._untimed: int | None = None  # the event the next counted op runs, to be timed

    # -- entering and leaving --

    def __enter__(self) -> SyncDetector:
        if self._stack is not None:
            raise RuntimeError("this SyncDetector is already active")
        self.thread = threading.get_ident()
        self.stopped = False
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(synchronize_layer(self))
            self.tracks_ops = self._arm_cuda()
            if self.tracks_ops:
                stack.enter_context(self._cuda_debug_warnings())
            if self.memory.simulating:
                stack.enter_context(optimizer_step_hooks(self))
            stack.enter_context(FunctionLayer(self))
            stack.enter_context(DispatchLayer(self))
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        self.inside = self._depth = self._call_events = self._owed = 0
        self._heard_in_call = False
        self._untimed = None
        self.timeline.close()
        self._ops.clear()
        if stack is not None:
            stack.close()

    @property
    def active(self) -> bool:
        return self._stack is not None

    def take(self) -> list[SyncEvent]:
        """The events so far with what they cost, removing them from ``events`` (and
        leaving ``cpu_only`` to ``take_cpu_only``)."""
        out, self.events = self.events, []
        for i, cost in self.timeline.take().items():
            if i < len(out):
                out[i] = dataclasses.replace(
                    out[i], host_ms=cost.host_ms, idle_after_ms=cost.idle_after_ms
                )
        return out

    def take_cpu_only(self) -> list[SyncEvent]:
        out, self.cpu_only = self.cpu_only, []
        return out

    # -- recording --

    def record(
        self,
        op: str,
        aten: str | None = None,
        forward: SyncEvent | None = None,
        hint: str = "",
        timed: bool = True,
        heard: bool = False,
    ) -> None:
        """Add an event for ``op`` at the current user frame (or at ``forward``'s: a backward
        op is attributed to the forward line that built it). ``timed``: the op runs next,
        and ``run_op`` (or the synchronize() wrapper) times it. ``heard``: CUDA's debug mode
        reported it, after the op (it is not a sync CUDA will report again)."""
        if (self.inside and not heard) or self.stopped:
            return
        if self.memory.simulating and excused():
            return
        backward = torch._C._current_autograd_node() is not None
        phase = "backward" if backward else self.phase
        if forward is not None:
            event = dataclasses.replace(forward, op=op, phase=phase, aten=aten)
        else:
            event = self.event_here(op, phase, aten)
        hint = fix_for(event.chain, hint, self.chain_hints)
        event = dataclasses.replace(event, hint=hint, allowed=ALLOWED.get())
        if event.cpu_only:
            self.cpu_only.append(event)  # seen here, not made on a GPU: not counted
            self._untimed = None
            return
        self.events.append(event)
        self._untimed = len(self.events) - 1 if timed else None
        if self.tracks_ops and (self._depth or not heard):
            self._call_events += 1  # CUDA's warnings for this call are this event's
        if self.strict and event.allowed is None:
            fix = f"; fix: {event.hint}" if event.hint else ""
            self.stopped = True
            raise SyncError(f"host-device sync: {event}{fix}")

    def event_here(self, op: str, phase: str, aten: str | None = None) -> SyncEvent:
        """The event for a sync at the current line; in the simulation, with the device
        branch it sits in (``syncs.device_branches``)."""
        event = event_here(op, phase, aten, self.origins)
        if self.memory.simulating:
            branch = self.guarded(device_branch, sys._getframe(1), self.memory.on_device)
            if branch is not None:  # None too where reading the source failed: counted
                event = dataclasses.replace(event, branch=branch.text, cpu_only=branch.cpu_only)
        return event

    def guarded(self, fn: Callable[..., T], *args: Any) -> T | None:
        """Run a piece of the detector's own machinery. Whatever goes wrong in it is counted
        in ``internal_errors`` and never reaches the watched program (``SyncError`` from
        ``strict`` is the one thing meant to)."""
        try:
            return fn(*args)
        except SyncError:
            raise
        except Exception:
            self.internal_errors += 1
            return None

    def run_op(
        self,
        func: Callable,
        args: tuple,
        kwargs: dict,
        name: Any,
        counted: bool,
        entered: float,
        aten: bool = False,
    ) -> Any:
        """Run an op seen by a layer whose handler began at ``entered`` (perf_counter).

        Inside a ``counted`` one, the ops it runs underneath are this same sync and are not
        recorded again; ``name`` (its ``str()``, taken only when one is heard) labels CUDA's
        warnings. The sync just recorded is timed;
        after one, the layer's own time is kept apart and an ``aten`` op that puts work on
        the device ends the idle (``gpu_busy.syncs.costs``).
        """
        timeline = self.timeline
        event = None
        if counted and not self.inside:
            event, self._untimed = self._untimed, None
        if event is not None or timeline.idle_since is not None:  # else nothing to time
            began = time.perf_counter()
            timeline.own(entered, began)
            if event is not None:
                timeline.began(event, began)
            elif aten and not self.inside and self.guarded(self._launches, func, args, kwargs):
                timeline.launch(began)
        if counted:
            self.inside += 1
        scoped = self.tracks_ops and self.begin_call(name, python=not aten)
        try:
            return func(*args, **kwargs)
        finally:
            if scoped:
                self.end_call()
            if counted:
                self.inside -= 1
            if event is not None:
                timeline.returned(time.perf_counter())

    def begin_call(self, name: Any = None, python: bool = True) -> bool:
        """A call the layers see begins (on the entering thread: True, and ``end_call``
        must follow). CUDA's warnings for the syncs inside it are heard before it ends,
        or, for an aten op run by a C++ binding the layers do not see (``Storage.copy_``
        in ``torch.save``), when that binding returns: always before Python makes its next
        call (``python``), so one ends what is still owed."""
        if threading.get_ident() != self.thread:
            return False  # the autograd engine's thread: its warnings replay on ours
        if python and not self._depth:
            self._owed = 0
        self._depth += 1
        self._ops.append(name)
        return True

    def end_call(self) -> None:
        self._ops.pop()
        self._depth -= 1
        if not self._depth:
            if self._call_events and not self._heard_in_call:
                self._owed += 1  # its warnings come when a binding around it returns
            self._call_events, self._heard_in_call = 0, False

    def take_untimed(self) -> int | None:
        """The event just recorded for an op about to run outside the layers (an explicit
        synchronize()), for the caller to time on ``timeline``."""
        event, self._untimed = self._untimed, None
        return event

    def _launches(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """Whether an aten op puts work on the device: not a view or a bare allocation, and
        it touches device memory or makes it."""
        if func.is_view or func.overloadpacket in NO_KERNEL:
            return False
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == self.memory.device_type:
            return not self.memory.simulating
        return any(self.memory.on_device(t) for t in tensors_of(args, kwargs))

    # -- the CUDA layer --

    def _arm_cuda(self) -> bool:
        return self.cuda_debug and debug_mode().serves(self.memory.device_type)

    def _cuda_debug_warnings(self) -> contextlib.AbstractContextManager:
        """CUDA's own account of the syncs, for what the rules miss.

        Its warning is a C++ warning, heard when the outermost Python call around the op
        returns (for a sync in ``backward()``, when ``backward()`` returns): after the
        layers have recorded the op, with no mark of which op it was, and as many times as
        the call waited inside (``repr`` of a CUDA tensor: 14 on a GPU machine, for one
        print). So the warnings of a call the layers recorded are that call's events, and
        a call they missed is one event, named after the call, however many it raised.
        ``run_op`` and the synchronize() wrappers open those calls. An aten op that a C++
        binding runs unseen by the function layer (``torch.save`` copying a storage) has its
        warning issued after the op's call ended; a recorded call that heard none owes one,
        paid by the next warning heard outside any call.
        """

        def on_sync() -> None:
            if self._depth:
                self._heard_in_call = True
                if self._call_events:
                    return  # this call's syncs are already counted
            elif self._owed:
                self._owed -= 1  # a recorded call's warning, issued by a binding around it
                return
            current = self._ops[-1] if self._ops else None
            name = f"{current} (CUDA sync debug)" if current else "a CUDA sync"
            self.record(name, timed=False, heard=True)  # heard after it returned

        return cuda_sync_warnings(on_sync)


def detect_syncs(
    device_type: str = "cuda", strict: bool = False, cuda_debug: bool = True, origins: tuple = ()
) -> SyncDetector:
    """A context manager recording every host-device sync while active.

    ``device_type``: which tensors count as device memory ("cuda"; "cpu" to simulate on
    CPU CI). ``strict``: raise ``SyncError`` at the first one. ``cuda_debug``: also arm
    CUDA's own sync debug mode (CUDA only). ``origins``: see ``SyncDetector``.

    Example::

        with detect_syncs(device_type="cpu") as rec:
            step(batch)
        assert not rec.events, "\\n".join(map(str, rec.events))
    """
    return SyncDetector(device_type, strict=strict, cuda_debug=cuda_debug, origins=origins)
