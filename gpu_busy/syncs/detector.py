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

import contextlib
import dataclasses
import linecache
import os
import re
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_busy.cuda_sync_warnings import cuda_sync_warnings

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
    read. ``aten`` is the aten op, when one was seen. ``simulated`` marks events that only
    the CPU simulation makes syncs: a library's ``.to(cpu)`` there (Lightning's batch
    transfer, a metric's state) is, on a GPU, the move *to* the device. The user's own
    ``.to("cpu")`` is never marked so.
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
    simulated: bool = False

    @property
    def location(self) -> str:
        return f"{_short_path(self.filename)}:{self.lineno}"

    def __str__(self) -> str:
        where = f"{self.op} at {self.location}"
        if self.function:
            where += f" in {self.function}"
        if self.via:
            where += f" (via {self.via})"
        if self.simulated:
            where += " [CPU simulation only]"
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
    """

    def __init__(
        self, device_type: str = "cuda", strict: bool = False, cuda_debug: bool = True
    ) -> None:
        self.device_type = torch.device(device_type).type
        self.strict = strict
        self.cuda_debug = cuda_debug
        self.phase = "forward"
        self.events: list[SyncEvent] = []
        self.internal_errors = 0  # failures of the detector's own code, kept from the program
        self._inside = 0  # >0 while a recorded op runs: what it calls is not counted again
        self._ops: list[str] = []  # aten/Python ops in flight, to name CUDA's warnings
        self._track_ops = False
        self._thread: int | None = None
        self._stack: contextlib.ExitStack | None = None

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
            stack.enter_context(_FunctionLayer(self))
            stack.enter_context(_DispatchLayer(self))
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        self._inside = 0
        self._ops.clear()
        if stack is not None:
            stack.close()

    @property
    def active(self) -> bool:
        return self._stack is not None

    def take(self) -> list[SyncEvent]:
        """The events so far, removing them from ``events``."""
        out, self.events = self.events, []
        return out

    # -- recording --

    def on_device(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.device.type == self.device_type

    def record(
        self,
        op: str,
        aten: str | None = None,
        forward: SyncEvent | None = None,
        simulated: bool = False,
    ) -> None:
        """Add an event for ``op`` at the current user frame (or at ``forward``'s: a backward
        op is attributed to the forward line that built it)."""
        if self._inside:
            return
        if self.device_type == "cpu" and _in_data_loader():
            # The DataLoader's own thread of work (num_workers=0) handles host tensors on
            # any machine: only the simulation would call them device memory.
            return
        backward = torch._C._current_autograd_node() is not None
        phase = "backward" if backward else self.phase
        if forward is not None:
            event = SyncEvent(
                op, forward.filename, forward.lineno, forward.function, forward.code, phase,
                aten, forward.chain, forward.via, simulated,
            )  # fmt: skip
        else:
            event = _event_here(op, phase, aten, simulated)
        if event.simulated and event.via is None:
            # Called by the user's own line, .to(cpu) means "to the host": a real read.
            event = dataclasses.replace(event, simulated=False)
        self.events.append(event)
        if self.strict and not event.simulated:
            raise SyncError(f"host-device sync: {event}")

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

    def run_op(self, func: Callable, args: tuple, kwargs: dict, name: str, counted: bool) -> Any:
        """Run an op seen by a layer. Inside a ``counted`` one, the ops it runs underneath
        are this same sync and are not recorded again; ``name`` labels CUDA's warnings."""
        if counted:
            self._inside += 1
        if self._track_ops:
            self._ops.append(name)
        try:
            return func(*args, **kwargs)
        finally:
            if self._track_ops:
                self._ops.pop()
            if counted:
                self._inside -= 1

    # -- the CUDA layer --

    def _arm_cuda(self) -> bool:
        return (
            self.cuda_debug
            and self.device_type == "cuda"
            and torch.cuda.is_available()
            and torch.cuda.is_initialized()
        )

    def _cuda_debug_warnings(self) -> contextlib.AbstractContextManager:
        def on_sync() -> None:
            current = self._ops[-1] if self._ops else None
            name = f"{current} (CUDA sync debug)" if current else "a CUDA sync"
            self.record(name, aten=current)

        return cuda_sync_warnings(on_sync)


def detect_syncs(
    device_type: str = "cuda", strict: bool = False, cuda_debug: bool = True
) -> SyncDetector:
    """A context manager recording every host-device sync while active.

    ``device_type``: which tensors count as device memory ("cuda"; "cpu" to simulate on
    CPU CI). ``strict``: raise ``SyncError`` at the first real one (not one only the CPU
    simulation sees). ``cuda_debug``: also arm
    CUDA's own sync debug mode (CUDA only).

    Example::

        with detect_syncs(device_type="cpu") as rec:
            step(batch)
        assert not rec.events, "\\n".join(map(str, rec.events))
    """
    return SyncDetector(device_type, strict=strict, cuda_debug=cuda_debug)


def assert_no_syncs(fn: Callable[..., T], *args: Any, device_type: str = "cpu", **kwargs: Any) -> T:
    """Call ``fn(*args, **kwargs)`` and fail with the offending lines if it syncs.

    Example::

        assert_no_syncs(model.training_step, batch, 0)   # AssertionError listing each line
    """
    with detect_syncs(device_type=device_type) as rec:
        result = fn(*args, **kwargs)
    if real := real_syncs(rec.events):
        name = getattr(fn, "__qualname__", repr(fn))
        raise AssertionError(f"{name} made {describe(real)}")
    return result


def real_syncs(events: list[SyncEvent]) -> list[SyncEvent]:
    """The events that make the host wait on a GPU too: what every count, ``strict`` and
    ``assert_no_syncs`` go by. The others exist only in the CPU simulation."""
    return [e for e in events if not e.simulated]


def describe(events: list[SyncEvent]) -> str:
    """``"2 host-device sync(s):"`` and one indented line per event."""
    lines = "\n".join(f"  {e}" for e in events)
    return f"{len(events)} host-device sync(s):\n{lines}"


_DATA_DIR = os.path.join(_TORCH_DIR, "utils", "data", "")


def _in_data_loader() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_DATA_DIR):
            return True
        frame = frame.f_back
    return False


def _event_here(op: str, phase: str, aten: str | None, simulated: bool = False) -> SyncEvent:
    chain: list[str] = []
    via = None
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_library(filename):
            code = linecache.getline(filename, frame.f_lineno).strip()
            return SyncEvent(
                op, filename, frame.f_lineno, frame.f_code.co_name, code, phase, aten,
                tuple(chain[:12]), via, simulated,
            )  # fmt: skip
        if not filename.startswith(_SYNCS_DIR):
            where = f"{_short_path(filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
            chain.append(where)
            if via is None and not filename.startswith(_TORCH_DIR):
                via = where
        frame = frame.f_back
    # No user frame at all (e.g. the autograd engine's own thread on CUDA).
    return SyncEvent(op, "<library>", 0, "", "", phase, aten, tuple(chain[:12]), via, simulated)


# -- layer 1: aten ops (TorchDispatchMode) ----------------------------------------------

aten = torch.ops.aten


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _has_mask(indices: Any) -> bool:
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()
    )


def _index_put_syncs(d: SyncDetector, args: tuple, kwargs: dict) -> bool:
    self_, indices, value = args[0], args[1], args[2]
    if not (d.on_device(self_) and _has_mask(indices)):
        return False
    accumulate = bool(_arg(args, kwargs, 3, "accumulate", False))
    # A one-element host value with one mask becomes masked_fill_ (no read-back). In the
    # CPU simulation the value is always "on the device", so a 0-dim value is trusted to
    # be the Python scalar that Python indexing passes.
    host_scalar = value.numel() == 1 and (
        not d.on_device(value) or (d.device_type == "cpu" and value.dim() == 0)
    )
    return accumulate or not host_scalar


def _copy_syncs(d: SyncDetector, src: torch.Tensor, dst_device: Any, non_blocking: bool) -> bool:
    """A blocking copy between the host and the device (CUDA only: a CPU has neither side)."""
    if d.device_type == "cpu" or non_blocking or dst_device is None:
        return False
    dst = torch.device(dst_device).type
    to_host = d.on_device(src) and dst == "cpu"
    return to_host or (src.device.type == "cpu" and dst == d.device_type)


# packet -> (name, does this call sync? (detector, args, kwargs) -> bool)
_ATEN_SYNCS: dict[Any, tuple[str, Callable[[SyncDetector, tuple, dict], bool]]] = {}


def _first_on_device(d: SyncDetector, args: tuple, kwargs: dict) -> bool:
    return bool(args) and d.on_device(args[0])


def _add(names: tuple[str, ...], label: str, check=_first_on_device) -> None:
    for name in names:
        packet = getattr(aten, name, None)
        if packet is not None:
            _ATEN_SYNCS[packet] = (label, check)


_add(("_local_scalar_dense",), "scalar read (.item(), float(t), bool(t), a tensor as a number)")
_add(("nonzero",), "nonzero / argwhere / torch.where(cond)")
_add(
    ("index", "_unsafe_index"),
    "x[mask] (boolean-mask index)",
    lambda d, a, k: d.on_device(a[0]) and _has_mask(a[1]),
)
_add(
    ("index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"),
    "x[mask] = tensor (boolean-mask assignment)",
    _index_put_syncs,
)
_add(("masked_select",), "masked_select")
_add(
    ("masked_fill", "masked_fill_"),
    "masked_fill with a tensor value",
    lambda d, a, k: len(a) > 2 and d.on_device(a[0]) and d.on_device(a[2]),
)
_add(
    ("_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive"), "unique"
)
_add(
    ("repeat_interleave",),
    "repeat_interleave without output_size",
    lambda d, a, k: d.on_device(a[0]) and k.get("output_size") is None,
)
_add(("bincount",), "bincount")
_add(
    ("histc",),
    "histc without min/max",
    lambda d, a, k: d.on_device(a[0]) and _arg(a, k, 2, "min", 0) == _arg(a, k, 3, "max", 0),
)
_add(("equal",), "torch.equal")
_add(("allclose",), "torch.allclose")
_add(("multinomial",), "multinomial")
_add(("_linalg_check_errors",), "linalg error check (inv, cholesky, solve, ...)")
_add(
    ("_ctc_loss", "ctc_loss"),
    "ctc_loss with length tensors",
    lambda d, a, k: any(d.on_device(x) for x in a[2:4]),
)
_add(
    ("_to_copy",),
    "blocking copy between host and device",
    lambda d, a, k: _copy_syncs(d, a[0], k.get("device"), bool(k.get("non_blocking", False))),
)
_add(
    ("copy_",),
    "blocking copy between host and device",
    lambda d, a, k: (
        _copy_syncs(d, a[1], a[0].device, bool(_arg(a, k, 2, "non_blocking", False)))
        or _copy_syncs(d, a[1], None, False)
    ),
)


class _DispatchLayer(TorchDispatchMode):
    def __init__(self, detector: SyncDetector) -> None:
        super().__init__()
        self.d = detector

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        d = self.d
        sync = d.guarded(self._observe, func, args, kwargs)
        return d.run_op(func, args, kwargs, str(func), counted=bool(sync))

    def _observe(self, func, args: tuple, kwargs: dict) -> bool:
        entry = _ATEN_SYNCS.get(func.overloadpacket)
        d = self.d
        if entry is None or d._inside or not entry[1](d, args, kwargs):
            return False
        label = entry[0]
        forward = None
        if func.overloadpacket in _MASK_BACKWARD_OPS:
            node = torch._C._current_autograd_node()
            if node is not None:
                label = "backward of x[mask] (boolean-mask index)"
                forward = node.metadata.get(_FORWARD_EVENT)
        d.record(label, aten=str(func), forward=forward)
        return True


_MASK_BACKWARD_OPS = {
    getattr(aten, n) for n in ("index_put", "index_put_", "_index_put_impl_") if hasattr(aten, n)
}
_FORWARD_EVENT = "gpu_busy_forward_event"


# -- layer 2: Python-level reads (TorchFunctionMode) --------------------------------------


def _to_target(args: tuple, kwargs: dict) -> tuple[Any, torch.Tensor | None, bool]:
    """``(device, tensor or None, non_blocking)`` of a ``Tensor.to`` call in each of its forms:
    ``to(device, dtype, non_blocking, copy)``, ``to(dtype, non_blocking, copy)``,
    ``to(tensor, non_blocking, copy)``, any of them as keywords, ``memory_format`` too."""
    rest = args[1:]
    device = kwargs.get("device")
    other = kwargs.get("tensor", rest[0] if rest else None)
    like = other if isinstance(other, torch.Tensor) else None
    if like is not None:
        device, flags = like.device, rest[1:]
    elif rest and (rest[0] is None or isinstance(rest[0], torch.dtype)):
        flags = rest[1:]
    elif rest:
        device, flags = rest[0], rest[2:]
    else:
        flags = ()
    return device, like, bool(kwargs.get("non_blocking", flags[0] if flags else False))


def _moves_to_host(d: SyncDetector, args: tuple, kwargs: dict) -> bool:
    device, like, non_blocking = _to_target(args, kwargs)
    if device is None or non_blocking:  # non_blocking: a pinned copy filled later, no wait
        return False
    # .to(other) goes where other is: to the device when other is device memory.
    return torch.device(device).type == "cpu" and not (like is not None and d.on_device(like))


_PY_READS: dict[Any, tuple[str, Callable[[SyncDetector, tuple, dict], bool] | None]] = {
    torch.Tensor.item: ("Tensor.item()", None),
    torch.Tensor.__bool__: ("bool(tensor) (if/while/and/or on a tensor)", None),
    torch.Tensor.__float__: ("float(tensor)", None),
    torch.Tensor.__int__: ("int(tensor)", None),
    torch.Tensor.__index__: ("tensor used as an index (__index__)", None),
    torch.Tensor.__complex__: ("complex(tensor)", None),
    torch.Tensor.__format__: ("format(tensor) / f-string", None),
    torch.Tensor.__repr__: ("print/repr/str(tensor)", None),
    torch.Tensor.tolist: ("Tensor.tolist()", None),
    torch.Tensor.numpy: ("Tensor.numpy()", None),
    torch.Tensor.__array__: ("np.asarray(tensor)", None),
    torch.Tensor.cpu: ("Tensor.cpu()", None),
    torch.Tensor.to: ("Tensor.to('cpu')", _moves_to_host),
}


class _FunctionLayer(TorchFunctionMode):
    def __init__(self, detector: SyncDetector) -> None:
        super().__init__()
        self.d = detector

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        d = self.d
        entry = _PY_READS.get(func)
        if entry is None:
            if func is torch.Tensor.__getitem__:
                return _tag_mask_index(d, func, args, kwargs)
            return func(*args, **kwargs)
        sync = d.guarded(self._observe, func, entry, args, kwargs)
        return d.run_op(func, args, kwargs, entry[0], counted=bool(sync))

    def _observe(self, func, entry, args: tuple, kwargs: dict) -> bool:
        d = self.d
        label, check = entry
        if not (args and d.on_device(args[0]) and (check is None or check(d, args, kwargs))):
            return False
        # In the simulation a library's .to(cpu) is what a GPU run's move to the device
        # becomes (record() keeps the user's own .to("cpu") a real read).
        d.record(label, simulated=func is torch.Tensor.to and d.device_type == "cpu")
        return True


def _tag_mask_index(d: SyncDetector, func, args: tuple, kwargs: dict):
    """x[mask]: remember the forward line on the autograd node, for its backward's sync."""
    out = func(*args, **kwargs)
    d.guarded(_tag, out, args)
    return out


def _tag(out: Any, args: tuple) -> None:
    index = args[1] if len(args) > 1 else None
    indices = index if isinstance(index, tuple) else (index,)
    grad_fn = getattr(out, "grad_fn", None)
    if grad_fn is not None and _has_mask(indices):
        grad_fn.metadata[_FORWARD_EVENT] = _event_here("x[mask]", "forward", None)


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
            for d in list(cls._active):
                if d._thread == me and (device is None or device == d.device_type):
                    d.record(label)
            return original(*args, **kwargs)

        synchronize.__wrapped__ = original
        return synchronize


__all__ = [
    "SyncDetector", "SyncError", "SyncEvent", "assert_no_syncs", "detect_syncs", "real_syncs",
]  # fmt: skip
