"""The three layers that see a sync as it happens: aten ops (``TorchDispatchMode``), the
Python-level calls (``TorchFunctionMode``, which also marks a forward whose backward will
sync) and the explicit ``synchronize()`` entry points. Each hands what it sees to its
``SyncDetector``."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_busy.cuda_sync_warnings import synchronize_calls_heard
from gpu_busy.syncs.attribution import (
    AFTER_OPTIMIZER_STEP,
    OPTIMIZER_STEP,
    PACKAGE_DIR,
    TORCH_DIR,
    SyncEvent,
)
from gpu_busy.syncs.costs import SyncTimeline
from gpu_busy.syncs.memory import COPY, HostMemory
from gpu_busy.syncs.rules import ATEN_RULES, BACKWARD_RULES, PYTHON_RULES, Rule


class Detector(Protocol):
    """What the layers use of the detector they report to: ``syncs.detector.SyncDetector``,
    which imports these layers (``tests/syncs/test_syncs.py`` holds both to this list)."""

    memory: HostMemory  # which tensors are device memory, on a GPU or simulated
    timeline: SyncTimeline  # what each sync cost
    phase: str  # the label of events outside backward
    inside: int  # >0 while a recorded op runs: what it calls is the same sync
    thread: int | None  # the thread that entered: the one whose calls count
    tracks_ops: bool  # CUDA's debug mode is on: ops are named for its warnings

    def record(
        self,
        op: str,
        aten: str | None = None,
        forward: SyncEvent | None = None,
        hint: str = "",
        timed: bool = True,
        heard: bool = False,
    ) -> None: ...

    def event_here(self, op: str, phase: str, aten: str | None = None) -> SyncEvent: ...

    def guarded(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    def run_op(
        self,
        func: Callable,
        args: tuple,
        kwargs: dict,
        name: Any,
        counted: bool,
        entered: float,
        aten: bool = False,
    ) -> Any: ...

    def begin_call(self, name: Any = None, python: bool = True) -> bool: ...

    def end_call(self) -> None: ...

    def take_untimed(self) -> int | None: ...


# -- layer 1: aten ops (TorchDispatchMode) ----------------------------------------------


class DispatchLayer(TorchDispatchMode):
    def __init__(self, detector: Detector) -> None:
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
        if d.memory.simulating and d.memory.mirroring and func is COPY:
            d.guarded(d.memory.follow_mirror, args)
        if d.memory.simulating and d.memory.knows_host_tensors:
            d.guarded(d.memory.follow_inputs, args, kwargs, out)
        if returned is not None:
            d.timeline.own(returned, time.perf_counter())
        return out

    def _observe(self, func, args: tuple, kwargs: dict) -> bool:
        d = self.d
        if d.inside:
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
        mirror = d.memory.host_mirror_of(func, args)
        if mirror is not None:
            d.record(mirror[0], aten=str(func), hint=mirror[1])
            return True
        if d.memory.mirroring and func is _SCALAR_READ and _in_a_cpp_gradient_hook(node):
            # DDP's reducer reading its host map from its C++ hook on a parameter's
            # AccumulateGrad (reducer.cpp, autograd_hook), before the first copy has
            # shown which tensor that map is: a host read on a GPU.
            return False
        rule = ATEN_RULES.get(func.overloadpacket)
        if rule is None:
            return False
        form, count = rule.match(d.memory, args, kwargs)
        if count:
            d.record(form.label, aten=str(func), hint=form.hint)
        return count > 0


_BACKWARD_SYNC = "gpu_busy_backward_sync"
_SCALAR_READ = torch.ops.aten._local_scalar_dense.default
_ENGINE = os.path.join(TORCH_DIR, "autograd", "graph.py")
_OP_CALL = os.path.join(TORCH_DIR, "_ops.py")  # OpOverload.__call__: a mode passing an op on
# Frames between a dispatched op and the code that ran it: this package's layers and the
# wrapper torch puts around a mode's __torch_dispatch__ (torch._disable_dynamo).
_NOT_CALLERS = (
    PACKAGE_DIR,
    os.path.join(TORCH_DIR, "_dynamo", "eval_frame.py"),
    os.path.join(TORCH_DIR, "_compile.py"),
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
NO_KERNEL = frozenset(
    getattr(torch.ops.aten, name)
    for name in ("empty", "empty_strided", "empty_like", "_unsafe_view", "set_", "resize_")
)
_RECORDED = "gpu_busy_backward_recorded"


# -- layer 2: Python-level calls (TorchFunctionMode) --------------------------------------


class FunctionLayer(TorchFunctionMode):
    def __init__(self, detector: Detector) -> None:
        super().__init__()
        self.d = detector

    def __torch_function__(self, func, types, args=(), kwargs=None):
        entered = time.perf_counter()
        kwargs = kwargs or {}
        d = self.d
        rule = PYTHON_RULES.get(func)
        if rule is None and d.tracks_ops:
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
        if d.memory.simulating:
            placed = d.guarded(d.memory.place, func, args, kwargs, out)
            out = out if placed is None else placed
        if returned is not None:
            d.timeline.own(returned, time.perf_counter())
        return out

    def _observe(self, rule: Rule, args: tuple, kwargs: dict) -> bool:
        if self.d.inside:
            return False
        form, count = rule.match(self.d.memory, args, kwargs)
        for _ in range(count):  # one event per sync: x[mask, idx] = 1.0 makes two
            self.d.record(form.label, hint=form.hint)
        return count > 0

    def _tag_backward(self, rule: Rule, args: tuple, kwargs: dict, out: Any) -> None:
        """Remember on the autograd node that its backward syncs, and the forward line."""
        grad_fn = getattr(out, "grad_fn", None)
        if grad_fn is not None and rule.applies(self.d.memory, args, kwargs):
            grad_fn.metadata[_BACKWARD_SYNC] = (rule, self.d.event_here(rule.label, "forward"))


@contextlib.contextmanager
def optimizer_step_hooks(d: Detector) -> Iterator[None]:
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
                    d.memory.mark_host(step)

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


def synchronize_layer(detector: Detector) -> contextlib.AbstractContextManager:
    """The explicit synchronize() calls on the detector's thread and of its device type:
    each recorded, timed, and opened as a call whose CUDA warning (Stream.synchronize()'s)
    is this same sync."""

    def on_call(label: str, device: str | None, reported: bool) -> Callable | None:
        ours = device is None or device == detector.memory.device_type
        if detector.thread != threading.get_ident() or not ours:
            return None
        detector.record(label)
        event = detector.take_untimed()
        scoped = detector.tracks_ops and detector.begin_call(label)

        def returned(began: float, at: float) -> None:
            if event is not None:
                detector.timeline.began(event, began)
                detector.timeline.returned(at)
            if scoped:
                detector.end_call()

        return returned

    return synchronize_calls_heard(on_call)
