"""Find every operation that makes the host wait for the device, and name the line.

``detect_syncs`` records each sync while it is active, with the innermost frame of *your*
code (going outward from the op: not an installed library, the standard library or this
package's mechanisms), the library chain in between and the phase. Three layers see them:
a ``TorchDispatchMode`` with a table of the aten ops that read device memory back, a
``TorchFunctionMode`` for the Python-level reads (``.item()``, ``bool(t)``, ``.cpu()``,
``.tolist()``, ``print(t)``, ...), and wrappers around explicit ``synchronize()``; on CUDA
``set_sync_debug_mode("warn")`` catches what the table misses. With ``device_type="cpu"``
every CPU tensor counts as device memory, so a machine without a GPU finds the same
lines. Active, it costs a Python call per aten op: watch a sample of steps, as
``SyncPointDetector`` does. Details: docs/ARCHITECTURE.md, "Finding host-device syncs".

Example::

    with detect_syncs(device_type="cuda") as rec:
        loss = model(x).loss
        print(f"loss {loss.item():.3f}")          # a sync
    for e in rec.events:
        print(e)        # "Tensor.item() at train.py:42 in step: print(f'loss {loss...'"

    assert_no_syncs(training_step, batch, device_type="cpu")   # in CI, no GPU needed
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import linecache
import os
import re
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

import gpu_busy.cuda_sync_warnings as warning_hook
from gpu_busy.cuda_sync_warnings import cuda_sync_warnings, debug_mode
from gpu_busy.syncs.costs import SyncTimeline
from gpu_busy.syncs.rules import (
    ATEN_RULES,
    BACKWARD_RULES,
    FACTORIES,
    LIBRARY_READS,
    PYTHON_RULES,
    DeviceTypeName,
    Rule,
    means_host,
    move_target,
)

T = TypeVar("T")


class SyncError(RuntimeError):
    """A host-device sync where ``strict`` detection allowed none."""


@dataclass(frozen=True)
class SyncEvent:
    """One operation that made (or, on a real device, would make) the host wait.

    ``filename``/``lineno``/``function``/``code`` are the innermost frame of user code;
    ``chain`` lists the library frames between it and the op, innermost first
    (``"lightning/pytorch/loops/training_epoch_loop.py:269 in _broadcast_sigterm_tensor"``).
    ``via`` is the innermost of those outside torch: the library line that asked for the
    read. ``aten`` is the aten op, when one was seen; ``hint`` what to do instead, from the
    rule that matched (``gpu_busy.syncs.rules``). ``host_ms`` and ``idle_after_ms`` are what
    it cost, on the host clock (``gpu_busy.syncs.costs``; None: not measured).
    """

    op: str
    filename: str
    lineno: int
    function: str = ""
    code: str = ""
    phase: str = "forward"
    aten: str | None = None
    chain: tuple[str, ...] = ()
    via: str | None = None
    hint: str = ""
    allowed: str | None = None  # the reason given to allow_syncs around it
    host_ms: float | None = None
    idle_after_ms: float | None = None

    @property
    def location(self) -> str:
        return f"{_short_path(self.filename)}:{self.lineno}"

    def __str__(self) -> str:
        where = f"{self.op} at {self.location}"
        if self.function:
            where += f" in {self.function}"
        if self.via:
            where += f" (via {self.via})"
        if self.allowed:
            where += f" [allowed: {self.allowed}]"
        return f"{where}: {self.code}" if self.code else where


# -- what counts as user code --------------------------------------------------------

# With a trailing separator: "torchmetrics/" must not pass for "torch/".
_SYNCS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# The measuring package counts as a library, wherever it is installed (an editable install
# is not under site-packages); its Lightning callbacks do not: a sync one of them makes
# on a logging step is reported at its line, so it can be seen and judged.
_PACKAGE_DIR = os.path.dirname(_SYNCS_DIR.rstrip(os.sep)) + os.sep
_CALLBACKS_DIR = _PACKAGE_DIR + "callbacks" + os.sep
_STDLIB_DIRS = tuple(
    {os.path.abspath(p) for p in (sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib"))}
)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# The route CUDA's warnings travel (the warnings module, the shared hook) is no place to
# name: a warning heard outside any call is named after the first frame beyond it.
_WARNING_ROUTE = (os.path.abspath(warning_hook.__file__), os.path.abspath(warnings.__file__))
_INSTALLED = re.compile(r"[\\/](?:site|dist)-packages[\\/]")
_is_library_cache: dict[str, bool] = {}


def _is_library(filename: str) -> bool:
    """Installed packages, the standard library, frozen modules and this package."""
    known = _is_library_cache.get(filename)
    if known is None:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        known = (
            filename.startswith("<frozen")
            or (path.startswith(_PACKAGE_DIR) and not path.startswith(_CALLBACKS_DIR))
            or bool(_INSTALLED.search(path))
            or path.startswith(_STDLIB_DIRS)
        )
        _is_library_cache[filename] = known
    return known


def _short_path(filename: str) -> str:
    """Path after site-packages for libraries, relative to the working directory otherwise."""
    m = _INSTALLED.search(filename)
    if m:
        return filename[m.end() :]
    try:
        rel = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        return filename
    return filename if rel.startswith("..") else rel


# -- the detector ----------------------------------------------------------------------


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
        self.device_type = torch.device(device_type).type
        self.origins = origins
        self.chain_hints = chain_hints
        # On a machine without the device, its tensors are CPU tensors: the simulation.
        self.simulating = self.device_type == "cpu"
        self._host = WeakIdKeyDictionary()  # simulation: tensors that live on the host
        self._mirrors: dict[int, tuple[str, str]] = {}  # see copies_to_host
        self.strict = strict
        self.cuda_debug = cuda_debug
        self.phase = "forward"
        self.events: list[SyncEvent] = []
        self.internal_errors = 0  # failures of the detector's own code, kept from the program
        self._inside = 0  # >0 while a recorded op runs: what it calls is not counted again
        self._ops: list[Any] = []  # ops in flight: their str() names CUDA's warnings
        self._track_ops = False
        # CUDA's warnings come late (see _cuda_debug_warnings): the calls the layers are
        # running on the entering thread, the events recorded since the outermost began,
        # whether a warning was heard in it, and the recorded calls whose warnings are
        # still to come from a binding around them that the layers do not see.
        self._depth = 0
        self._call_events = 0
        self._heard_in_call = False
        self._owed = 0
        self._thread: int | None = None
        self._stack: contextlib.ExitStack | None = None
        self.timeline = SyncTimeline()  # what each event cost, by its index in events
        self._untimed: int | None = None  # the event the next counted op runs, to be timed

    # -- entering and leaving --

    def __enter__(self) -> SyncDetector:
        if self._stack is not None:
            raise RuntimeError("this SyncDetector is already active")
        self._thread = threading.get_ident()
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(_SynchronizeHooks.install(self))
            self._track_ops = self._arm_cuda()
            if self._track_ops:
                stack.enter_context(self._cuda_debug_warnings())
            if self.simulating:
                stack.enter_context(_optimizer_step_hooks(self))
            stack.enter_context(_FunctionLayer(self))
            stack.enter_context(_DispatchLayer(self))
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        self._inside = self._depth = self._call_events = self._owed = 0
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
        """The events so far with what they cost, removing them from ``events``."""
        out, self.events = self.events, []
        for i, cost in self.timeline.take().items():
            if i < len(out):
                out[i] = dataclasses.replace(
                    out[i], host_ms=cost.host_ms, idle_after_ms=cost.idle_after_ms
                )
        return out

    # -- recording --

    def on_device(self, value: Any) -> bool:
        """Whether ``value`` is device memory, the one question every rule asks.

        On a GPU: a tensor on it. In the CPU simulation: a CPU tensor that a GPU run would
        hold on the device, i.e. any tensor except those made on the host while watching: a
        factory call without ``device=`` (or with the string ``"cpu"``), ``.cpu()``,
        ``.to("cpu")``, whatever is computed from host tensors alone, and what
        ``mark_host`` was given (an optimizer's step counters). A read of a host tensor is
        no sync; a blocking copy of one to the device is.
        """
        return (
            isinstance(value, torch.Tensor)
            and value.device.type == self.device_type
            and not (self.simulating and value in self._host)
        )

    def mark_host(self, *tensors: Any) -> None:
        """In the CPU simulation, count these tensors as host memory."""
        if self.simulating:
            self._put(list(tensors), on_host=True)

    def batch_from_host(self, batch: Any) -> None:
        """In the simulation, a batch the DataLoader handed over is host memory, as it is on
        a GPU until something moves it: its tensors, in collections and in a batch object's
        attributes, are marked host. A move to the device returns a device tensor
        (``place``); a blocking one is a sync, as a batch class's ``.to`` is on a GPU."""
        if self.simulating and self.active:
            self.mark_host(*_held_tensors(batch))

    def copies_to_host(self, tensor: torch.Tensor, label: str, hint: str) -> None:
        """``tensor`` is device memory that a library copies into a host tensor of its own
        (``copy_`` in C++, then host reads of that copy): each such copy is one event,
        ``label`` with ``hint``, and in the CPU simulation its destination is host memory.
        DDP's reducer does this with its used-parameter map under
        ``find_unused_parameters=True``: one blocking copy per backward on a GPU."""
        self._mirrors[tensor.data_ptr()] = (label, hint)

    def host_mirror_of(self, func: Any, args: tuple) -> tuple[str, str] | None:
        """The (label, hint) of a ``copy_`` out of a tensor given to ``copies_to_host``."""
        if not self._mirrors or func is not _COPY or len(args) < 2:
            return None
        src = args[1]
        return self._mirrors.get(src.data_ptr()) if isinstance(src, torch.Tensor) else None

    def follow_mirror(self, args: tuple) -> None:
        """In the simulation, the library's own copy on the other side of a mirrored
        device tensor (what it copies into it, and out of it) is host memory."""
        dst, src = args[0], args[1]
        if src.data_ptr() in self._mirrors:
            self.mark_host(dst)
        elif dst.data_ptr() in self._mirrors:
            self.mark_host(src)

    def follow_inputs(self, args: tuple, kwargs: dict, out: Any) -> None:
        """What is computed from host tensors alone is on the host."""
        inputs = _tensors(args, kwargs)
        if inputs and all(t in self._host for t in inputs):
            self.mark_host(*_flat(out))

    def place(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        """Where a Python-level call put its result, the host or the device; returns the
        result. A move (``.cpu()``, ``.to(...)``, ``.type_as(...)``) of a CPU tensor that
        is already where it goes returns the tensor itself: the simulation hands back a
        view of it instead (a new tensor, as on a GPU, with the same values and autograd),
        so that marking the result leaves the source where it was. ``p.data = t`` (how
        ``Module.to`` moves parameters) puts ``p`` where ``t`` is."""
        target = move_target(self, func, args, kwargs)
        if target is not None:
            on_host = target
        elif func in FACTORIES and not _excused_in_simulation():
            device = kwargs.get("device")
            on_host = device is None or means_host(self, device)
        elif _sets_data(func) and len(args) == 2 and isinstance(args[1], torch.Tensor):
            self._put(args[0], args[1] in self._host)
            return out
        elif func is torch.Tensor.type and isinstance(out, str) and self.on_device(args[0]):
            return DeviceTypeName(out)  # what x.type() names on a GPU: a device type
        else:
            return out
        if isinstance(out, torch.Tensor) and args and out is args[0]:
            if on_host == (out in self._host):
                return out  # already where it goes: no copy on a GPU either
            out = out.view_as(out)
        self._put(out, on_host)
        return out

    def _put(self, out: Any, on_host: bool) -> None:
        for t in _flat(out):
            if on_host:
                self._host[t] = True
            else:
                self._host.pop(t, None)

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
        if self._inside and not heard:
            return
        if self.simulating and _excused_in_simulation():
            return
        backward = torch._C._current_autograd_node() is not None
        phase = "backward" if backward else self.phase
        if forward is not None:
            event = dataclasses.replace(forward, op=op, phase=phase, aten=aten)
        else:
            event = _event_here(op, phase, aten, self.origins)
        hint = fix_for(event.chain, hint, self.chain_hints)
        event = dataclasses.replace(event, hint=hint, allowed=_ALLOWED.get())
        self.events.append(event)
        self._untimed = len(self.events) - 1 if timed else None
        if self._track_ops and (self._depth or not heard):
            self._call_events += 1  # CUDA's warnings for this call are this event's
        if self.strict and event.allowed is None:
            fix = f"; fix: {event.hint}" if event.hint else ""
            raise SyncError(f"host-device sync: {event}{fix}")

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
        if counted and not self._inside:
            event, self._untimed = self._untimed, None
        if event is not None or timeline.idle_since is not None:  # else nothing to time
            began = time.perf_counter()
            timeline.own(entered, began)
            if event is not None:
                timeline.began(event, began)
            elif aten and not self._inside and self.guarded(self._launches, func, args, kwargs):
                timeline.launch(began)
        if counted:
            self._inside += 1
        scoped = self._track_ops and self.begin_call(name, python=not aten)
        try:
            return func(*args, **kwargs)
        finally:
            if scoped:
                self.end_call()
            if counted:
                self._inside -= 1
            if event is not None:
                timeline.returned(time.perf_counter())

    def begin_call(self, name: Any = None, python: bool = True) -> bool:
        """A call the layers see begins (on the entering thread: True, and ``end_call``
        must follow). CUDA's warnings for the syncs inside it are heard before it ends,
        or, for an aten op run by a C++ binding the layers do not see (``Storage.copy_``
        in ``torch.save``), when that binding returns: always before Python makes its next
        call (``python``), so one ends what is still owed."""
        if threading.get_ident() != self._thread:
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
        if func.is_view or func.overloadpacket in _NO_KERNEL:
            return False
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == self.device_type:
            return not self.simulating
        return any(self.on_device(t) for t in _tensors(args, kwargs))

    # -- the CUDA layer --

    def _arm_cuda(self) -> bool:
        return self.cuda_debug and debug_mode().serves(self.device_type)

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


def fix_for(chain: tuple[str, ...], hint: str, chain_hints: tuple[tuple[str, str], ...] = ()):
    """The one fix for a sync: by a function in the library chain that made it
    (``chain_hints`` first, then a library's, ``rules.LIBRARY_READS``; first match wins),
    else ``hint``, the fix of the rule that matched."""
    joined = " ".join(chain)
    for marker, fix in (*chain_hints, *LIBRARY_READS):
        if marker in joined:
            return fix
    return hint


# The phase a caller names for an optimizer step, and the one after it returns.
OPTIMIZER_STEP, AFTER_OPTIMIZER_STEP = "optimizer step", "after optimizer step"

_ALLOWED: contextvars.ContextVar[str | None] = contextvars.ContextVar("allowed", default=None)


class allow_syncs(contextlib.ContextDecorator):
    """Mark the syncs in a block (or a function) as deliberate, with the reason.

    They are still recorded and counted (they cost what they cost), listed with the
    reason, and neither ``strict`` nor ``assert_no_syncs`` nor ``no_syncs`` fails on them.

    Example::

        with allow_syncs("early stopping reads the loss once per epoch"):
            best = val_loss.item()

        @allow_syncs("a debug dump, every 1000 steps")
        def dump(t): print(t)
    """

    def __init__(self, reason: str) -> None:
        if not reason:
            raise ValueError("allow_syncs needs a reason: say why this sync is fine")
        self.reason = reason
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> allow_syncs:
        self._tokens.append(_ALLOWED.set(self.reason))
        return self

    def __exit__(self, *exc: Any) -> None:
        _ALLOWED.reset(self._tokens.pop())


def not_allowed(events: list[SyncEvent]) -> list[SyncEvent]:
    """The events no ``allow_syncs`` covered: what strict checks fail on."""
    return [e for e in events if e.allowed is None]


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments of a call, one level into lists and tuples."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, list | tuple):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _held_tensors(obj: Any, depth: int = 4, seen: set[int] | None = None) -> list[torch.Tensor]:
    """The tensors ``obj`` holds: itself, or inside dicts, sequences and an object's
    attributes (a batch class), ``depth`` levels down. (``apply_to_collection`` stops at
    a batch class, whose tensors are what its own ``.to`` copies.)"""
    if isinstance(obj, torch.Tensor):
        return [obj]
    seen = set() if seen is None else seen
    if depth == 0 or id(obj) in seen or isinstance(obj, str | bytes | int | float | bool):
        return []
    seen.add(id(obj))
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, list | tuple | set | frozenset):
        items = list(obj)
    else:
        items = list(getattr(obj, "__dict__", {}).values())
    return [t for item in items for t in _held_tensors(item, depth - 1, seen)]


def held_outside_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors a module and its submodules keep as plain attributes, in lists, dicts and
    deques too (a replay buffer's first entries, torchvision's cell anchors). ``Module.to``
    moves only parameters and buffers (torch/nn/modules/module.py, ``Module._apply``), so on
    a GPU these stay on the host where ``__init__`` made them. A module class with its own
    ``_apply`` (a torchmetrics ``Metric`` moves its states there) is left out: it may move
    them."""
    out: list[torch.Tensor] = []

    def walk(value: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            out.append(value)
        elif depth and isinstance(value, dict):
            for v in value.values():
                walk(v, depth - 1)
        elif depth and isinstance(value, list | tuple | set | frozenset | collections.deque):
            for v in value:
                walk(v, depth - 1)

    for m in module.modules():
        if type(m)._apply is not torch.nn.Module._apply:
            continue
        for name, value in vars(m).items():
            if name not in ("_parameters", "_buffers", "_modules"):
                walk(value, depth=3)
    return out


def _flat(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, list | tuple):
        return [x for x in out if isinstance(x, torch.Tensor)]
    return []


def describe(events: list[SyncEvent]) -> str:
    """``"2 host-device sync(s):"`` and one indented line per event."""
    lines = "\n".join(f"  {e}" for e in events)
    return f"{len(events)} host-device sync(s):\n{lines}"


_DATA_DIR = os.path.join(_TORCH_DIR, "utils", "data", "")


def _excused_in_simulation() -> bool:
    """What the CPU simulation sees that a GPU run does not do, decided in this one place:
    the DataLoader's own work (num_workers=0), which handles host tensors on any machine.

    Reads of host tensors are not excused here: ``SyncDetector.on_device`` never calls
    them device memory in the first place. Lightning's batch transfer is not excused
    either: ``lightning_compat.moves_to_the_cpu_as_to_cuda`` makes it pass the
    ``non_blocking`` it passes on CUDA, and a batch class's own ``.to`` decides as it does
    on a GPU.
    """
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_DATA_DIR):
            return True
        frame = frame.f_back
    return False


def user_frame(frame: Any) -> Any:
    """The innermost frame of user code at or outside ``frame``; None if there is none
    inside the training loop (see ``_event_here``)."""
    while frame is not None and _is_library(frame.f_code.co_filename):
        if _TRAINING_LOOP.search(frame.f_code.co_filename):
            return None
        frame = frame.f_back
    return frame


def _event_here(op: str, phase: str, aten: str | None, origins: tuple = ()) -> SyncEvent:
    """The event at the innermost user frame, going outward from the op.

    A user frame reached only through a training loop (Lightning's loops or Trainer) is the
    code that started training, not what asked for the read: the event then names the
    user line one of ``origins`` finds for a library frame (see ``SyncDetector``), else
    the library line that asked (``via``), as it does when no user frame exists at all
    (the autograd engine's own thread on CUDA)."""
    chain: list[str] = []
    via = via_frame = None
    in_loop = False
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_library(filename) and not in_loop:
            return _event_at(op, frame, phase, aten, tuple(chain[:12]), via)
        if not _is_library(filename):
            break
        if not filename.startswith(_SYNCS_DIR) and filename not in _WARNING_ROUTE:
            where = f"{_short_path(filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
            chain.append(where)
            if not filename.startswith(_TORCH_DIR):
                frames.append((frame, where))
                if via is None:
                    via, via_frame = where, frame
            in_loop = in_loop or bool(_TRAINING_LOOP.search(filename))
        frame = frame.f_back
    for library_frame, where in frames:
        for origin in origins:
            try:
                found = origin(library_frame)
            except Exception:  # a wrong guess must not cost the event, nor the program
                found = None
            if found is not None:
                filename, lineno, function, *reader = found
                # the via names who asked for the read (an origin may say: the loop, a
                # progress bar), else the library frame that found the line
                if reader and reader[0] is not None:
                    asked, code = reader[0], reader[0].f_code
                    where = f"{_short_path(code.co_filename)}:{asked.f_lineno} in {code.co_name}"
                return _event_at_line(op, filename, lineno, phase, aten, tuple(chain[:12]),
                                      where, function)  # fmt: skip
    if via_frame is not None:
        return _event_at(op, via_frame, phase, aten, tuple(chain[:12]), None)
    return SyncEvent(op, "<library>", 0, "", "", phase, aten, tuple(chain[:12]), via)


def _event_at(op: str, frame: Any, phase: str, aten: str | None, chain: tuple, via: Any):
    return _event_at_line(op, frame.f_code.co_filename, frame.f_lineno, phase, aten, chain,
                          via, frame.f_code.co_name)  # fmt: skip


def _event_at_line(op: str, filename: str, lineno: int, phase: str, aten: str | None,
                   chain: tuple, via: Any, function: str = "") -> SyncEvent:  # fmt: skip
    code = linecache.getline(filename, lineno).strip()
    return SyncEvent(op, filename, lineno, function, code, phase, aten, chain, via)


# Where a training loop runs: a user frame outside it only started training.
_TRAINING_LOOP = re.compile(r"lightning[\\/]pytorch[\\/](?:loops|trainer)[\\/]")


# -- layer 1: aten ops (TorchDispatchMode) ----------------------------------------------


class _DispatchLayer(TorchDispatchMode):
    def __init__(self, detector: SyncDetector) -> None:
        super().__init__()
        self.d = detector

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        entered = time.perf_counter()
        kwargs = kwargs or {}
        d = self.d
        sync = d.guarded(self._observe, func, args, kwargs)
        # the op itself for its name: str() only where a CUDA warning is heard inside it
        out = d.run_op(func, args, kwargs, func, bool(sync), entered, aten=True)
        returned = time.perf_counter() if d.timeline.idle_since is not None else None
        if d.simulating and d._mirrors and func is _COPY:
            d.guarded(d.follow_mirror, args)
        if d.simulating and d._host:
            d.guarded(d.follow_inputs, args, kwargs, out)
        if returned is not None:
            d.timeline.own(returned, time.perf_counter())
        return out

    def _observe(self, func, args: tuple, kwargs: dict) -> bool:
        d = self.d
        if d._inside:
            return False
        node = torch._C._current_autograd_node()
        backward = node.metadata.get(_BACKWARD_SYNC) if node is not None else None
        if backward is not None:
            # A backward that syncs (its forward rule said so): one event per node, at the
            # forward line; the ops it runs are that same sync.
            if not node.metadata.get(_RECORDED):
                node.metadata[_RECORDED] = True
                rule, forward = backward
                d.record(rule.label, aten=str(func), forward=forward, hint=rule.hint)
            return True
        mirror = d.host_mirror_of(func, args)
        if mirror is not None:
            d.record(mirror[0], aten=str(func), hint=mirror[1])
            return True
        if d._mirrors and func is _SCALAR_READ and _in_a_cpp_gradient_hook(node):
            # DDP's reducer reading its host map from its C++ hook on a parameter's
            # AccumulateGrad (reducer.cpp, autograd_hook), before the first copy has
            # shown which tensor that map is: a host read on a GPU.
            return False
        rule = ATEN_RULES.get(func.overloadpacket)
        if rule is None or not rule.applies(d, args, kwargs):
            return False
        d.record(rule.label, aten=str(func), hint=rule.hint)
        return True


_BACKWARD_SYNC = "gpu_busy_backward_sync"
_COPY = torch.ops.aten.copy_.default
_SCALAR_READ = torch.ops.aten._local_scalar_dense.default
_ENGINE = os.path.join(_TORCH_DIR, "autograd", "graph.py")
_OP_CALL = os.path.join(_TORCH_DIR, "_ops.py")  # OpOverload.__call__: a mode passing an op on
# Frames between a dispatched op and the code that ran it: this package's layers and the
# wrapper torch puts around a mode's __torch_dispatch__ (torch._disable_dynamo).
_NOT_CALLERS = (
    _PACKAGE_DIR,
    os.path.join(_TORCH_DIR, "_dynamo", "eval_frame.py"),
    os.path.join(_TORCH_DIR, "_compile.py"),
)


def _in_a_cpp_gradient_hook(node: Any) -> bool:
    """An op run by C++ code hooked on a parameter's gradient accumulation: the current
    autograd node is an ``AccumulateGrad`` and no Python frame stands between the op and
    the autograd engine's entry (a Python hook would be one). Another dispatch mode's own
    frames (``FlopCounterMode`` passing the op on) are not callers either."""
    if node is None or type(node).__name__ != "AccumulateGrad":
        return False
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_NOT_CALLERS)
        or frame.f_code.co_filename == _OP_CALL
        or isinstance(frame.f_locals.get("self"), TorchDispatchMode)
    ):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename == _ENGINE


# aten ops that allocate or alias without a kernel: not the end of an idle after a sync.
_NO_KERNEL = frozenset(
    getattr(torch.ops.aten, name)
    for name in ("empty", "empty_strided", "empty_like", "_unsafe_view", "set_", "resize_")
)
_RECORDED = "gpu_busy_backward_recorded"


# -- layer 2: Python-level calls (TorchFunctionMode) --------------------------------------


class _FunctionLayer(TorchFunctionMode):
    def __init__(self, detector: SyncDetector) -> None:
        super().__init__()
        self.d = detector

    def __torch_function__(self, func, types, args=(), kwargs=None):
        entered = time.perf_counter()
        kwargs = kwargs or {}
        d = self.d
        rule = PYTHON_RULES.get(func)
        if rule is None and d._track_ops:
            # Named: a CUDA warning heard when it returns may be a sync only CUDA saw.
            out = d.run_op(func, args, kwargs, _call_name(func), False, entered)
        elif rule is None:
            if d.timeline.idle_since is not None:
                d.timeline.own(entered, time.perf_counter())
            out = func(*args, **kwargs)
        else:
            sync = d.guarded(self._observe, rule, args, kwargs)  # None: the rule failed
            owned = bool(sync) or (rule.owns and sync is not None)
            out = d.run_op(func, args, kwargs, rule.label, owned, entered)
        returned = time.perf_counter() if d.timeline.idle_since is not None else None
        if func in BACKWARD_RULES:
            d.guarded(self._tag_backward, BACKWARD_RULES[func], args, kwargs, out)
        if d.simulating:
            placed = d.guarded(d.place, func, args, kwargs, out)
            out = out if placed is None else placed
        if returned is not None:
            d.timeline.own(returned, time.perf_counter())
        return out

    def _observe(self, rule: Rule, args: tuple, kwargs: dict) -> bool:
        count = 0 if self.d._inside else rule.count(self.d, args, kwargs)
        for _ in range(count):  # one event per sync: x[mask, idx] = 1.0 makes two
            self.d.record(rule.label, hint=rule.hint)
        return count > 0

    def _tag_backward(self, rule: Rule, args: tuple, kwargs: dict, out: Any) -> None:
        """Remember on the autograd node that its backward syncs, and the forward line."""
        grad_fn = getattr(out, "grad_fn", None)
        if grad_fn is not None and rule.applies(self.d, args, kwargs):
            grad_fn.metadata[_BACKWARD_SYNC] = (rule, _event_here(rule.label, "forward", None))


_DATA = torch._C.TensorBase.__dict__["data"]


@contextlib.contextmanager
def _optimizer_step_hooks(d: SyncDetector) -> Iterator[None]:
    """After each optimizer step, the phase the caller named for it ends. Before each, its
    step counters are host memory where a GPU run keeps
    them there: torch.optim's Adam and its kin unless capturable or fused
    (``torch/optim/adam.py``: ``_get_value(step)`` reads one with ``.item()``, no wait). So
    counters made before watching began, or loaded on resume, are not device reads."""

    def mark(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            if group.get("capturable") or group.get("fused"):
                continue
            for p in group["params"]:
                step = optimizer.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor) and step.numel() == 1:
                    d.mark_host(step)

    def stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # What runs after the step (a callback's on_train_batch_end) is not the step's.
        if d.phase == OPTIMIZER_STEP:
            d.phase = AFTER_OPTIMIZER_STEP

    handles = (
        register_optimizer_step_pre_hook(
            lambda optimizer, args, kwargs: d.guarded(mark, optimizer, args, kwargs)
        ),
        register_optimizer_step_post_hook(stepped),
    )
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _sets_data(func: Any) -> bool:
    """``tensor.data = other``, as the function layer sees it (a bound descriptor setter)."""
    return getattr(func, "__self__", None) is _DATA and getattr(func, "__name__", "") == "__set__"


def _call_name(func: Any) -> str:
    """``torch.nonzero``, ``Tensor.backward``: how the call reads in user code."""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    if not isinstance(name, str):
        return repr(func)
    owner, _, short = name.rpartition(".")
    if owner in ("TensorBase", "_TensorBase", "Tensor"):
        return f"Tensor.{short}"
    module = getattr(func, "__module__", None) or "torch"
    return f"{module}.{short}" if owner in ("", "_VariableFunctionsClass") else name


# -- layer 3: explicit synchronize() ---------------------------------------------------------


class _SynchronizeHooks:
    """Wraps the synchronize() entry points while at least one detector is active."""

    _lock = threading.Lock()
    _active: list[SyncDetector] = []
    _saved: list[tuple[Any, str, Any]] = []

    @classmethod
    def _targets(cls) -> list[tuple[Any, str, str, str | None]]:
        out: list[tuple[Any, str, str, str | None]] = [
            (torch.cuda, "synchronize", "torch.cuda.synchronize()", "cuda"),
            (torch.cuda.Stream, "synchronize", "Stream.synchronize()", "cuda"),
            (torch.cuda.Event, "synchronize", "Event.synchronize()", "cuda"),
        ]
        if hasattr(torch, "cpu") and hasattr(torch.cpu, "synchronize"):
            out.append((torch.cpu, "synchronize", "torch.cpu.synchronize()", "cpu"))
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and hasattr(accelerator, "synchronize"):
            out.append((accelerator, "synchronize", "torch.accelerator.synchronize()", None))
        return out

    @classmethod
    @contextlib.contextmanager
    def install(cls, detector: SyncDetector) -> Iterator[None]:
        with cls._lock:
            if not cls._active:
                for owner, attr, label, device in cls._targets():
                    original = getattr(owner, attr)
                    cls._saved.append((owner, attr, original))
                    setattr(owner, attr, cls._wrap(original, label, device))
            cls._active.append(detector)
        try:
            yield
        finally:
            with cls._lock:
                cls._active.remove(detector)
                if not cls._active:
                    for owner, attr, original in reversed(cls._saved):
                        setattr(owner, attr, original)
                    cls._saved.clear()

    @classmethod
    def _wrap(cls, original: Callable, label: str, device: str | None) -> Callable:
        def synchronize(*args, **kwargs):
            me = threading.get_ident()
            timed = []  # every detector that recorded it times it (nested ones too)
            calls = []  # and hears CUDA's warning for it (Stream.synchronize) as this one
            for d in list(cls._active):
                if d._thread == me and (device is None or device == d.device_type):
                    d.record(label)
                    event = d.take_untimed()
                    if event is not None:
                        timed.append((d.timeline, event))
                    if d._track_ops and d.begin_call(label):
                        calls.append(d)
            began = time.perf_counter()
            for timeline, event in timed:
                timeline.began(event, began)
            try:
                return original(*args, **kwargs)
            finally:
                returned = time.perf_counter()
                for timeline, _ in timed:
                    timeline.returned(returned)
                for d in calls:
                    d.end_call()

        synchronize.__wrapped__ = original
        return synchronize


__all__ = [
    "SyncDetector", "SyncError", "SyncEvent", "allow_syncs", "detect_syncs",
    "not_allowed",
]  # fmt: skip
