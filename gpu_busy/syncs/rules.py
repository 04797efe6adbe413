"""The one table of sync rules: which call makes the host wait, when, what to call it,
and what to do instead.

A rule's ``syncs(d, args, kwargs)`` answers for one call, with ``d.on_device(t)`` the one
test of device memory. ``ATEN_RULES`` are matched by the dispatch layer, ``PYTHON_RULES``
by the function layer, where a Python rule ``owns`` its call (what it runs underneath is
not counted again). Each case names its source in PyTorch.

Example::

    rule = PYTHON_RULES[torch.Tensor.item]
    rule.label, rule.hint        # "Tensor.item()", "log the tensor with self.log ..."
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

aten = torch.ops.aten

Check = Callable[[Any, tuple, dict], bool]

DEFER = (
    "keep it on the device, with ops whose output size is known on the host (bincount, "
    "unique, nonzero and x[mask] read a size back; this report gives their sync-free forms), "
    "or read it at logging steps"
)
LOG_IT = (
    "log the tensor with self.log (Lightning reduces it every log_every_n_steps) or keep it "
    'in a torchmetrics metric (MeanMetric(nan_strategy="disable"))'
)
# Ops that take a Python number (a size, a range's end, a slice bound) read it back.
NUMBER_HINT = (
    "an op that takes a Python number (a size, a range's end, a count) reads it from the "
    "device: no sync-free form; compute the number on the host (from shapes or host data), "
    "or use a fixed upper bound and a mask (torch.arange(bound, device=x.device) < n)"
)
MASK_INDEX_HINT = (
    "use torch.where(mask, x, 0) or masked_fill (the same shape), or index with "
    "torch.nonzero_static(mask, size=...)"
)
HOST_INDEX_HINT = (
    "make the index on the device (torch.arange or torch.full with device=x.device), or move "
    "it there once, outside the step"
)
TO_DEVICE_HINT = (
    "create it on the device (device=x.device), or copy it with non_blocking=True from "
    "pinned memory (the DataLoader's pin_memory=True, or .pin_memory() once)"
)
MASK_ASSIGN_HINT = (
    "use torch.where(mask, value, x), or masked_fill(mask, number) with a Python number "
    "(the mask the only index: fold another index into the mask first)"
)


@dataclass(frozen=True)
class Rule:
    label: str
    hint: str
    syncs: Check | None = None  # None: whenever its first argument is device memory
    owns: bool = False  # Python rules: the decision covers everything the call runs
    # One call, several ways to sync, each with its own fix (x[mask], x[i] with i a device
    # number): the first form that applies names the call.
    forms: tuple[Rule, ...] = ()

    def match(self, d: Any, args: tuple, kwargs: dict) -> tuple[Rule, int]:
        """The rule whose label and fix describe this call (this one or one of its forms),
        and how many syncs the call makes."""
        for form in self.forms:
            n = form.count(d, args, kwargs)
            if n:
                return form, n
        return self, 0 if self.forms else self.count(d, args, kwargs)

    def count(self, d: Any, args: tuple, kwargs: dict) -> int:
        """How many syncs the call makes: a check may give a number where one call makes
        several (a bool is 0 or 1)."""
        if self.forms:
            return self.match(d, args, kwargs)[1]
        if self.syncs is not None:
            return int(self.syncs(d, args, kwargs))
        return int(bool(args) and d.on_device(args[0]))

    def applies(self, d: Any, args: tuple, kwargs: dict) -> bool:
        return self.count(d, args, kwargs) > 0


def arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def index_parts(index: Any) -> tuple:
    return index if isinstance(index, tuple | list) else (index,)


# -- where a tensor goes -------------------------------------------------------------------


def means_host(d: Any, device: Any, like: torch.Tensor | None = None) -> bool:
    """Whether a target device is the host. ``.to(other)`` goes where ``other`` is. In the
    CPU simulation every device is "cpu": the target means the host where the line that
    asked writes the CPU (``.to("cpu")``, ``torch.device("cpu")``) or the program keeps
    that ``torch.device`` for the host; ``x.device``, ``self.device``, a variable, a
    string a function returned mean the device (``HostMemory.names_the_host``)."""
    if like is not None:
        return not d.on_device(like)
    if device is None:
        return False
    if d.simulating:
        return d.names_the_host(device)
    return torch.device(device).type == "cpu"


def to_target(args: tuple, kwargs: dict) -> tuple[Any, torch.Tensor | None, bool]:
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


class DeviceTypeName(str):
    """``x.type()`` of a device tensor in the CPU simulation: the same string as the CPU
    gives ("torch.FloatTensor"), remembered as naming a device type, so that
    ``h.type(x.type())`` moves ``h`` to the device as it does on a GPU."""


def move_target(d: Any, func: Any, args: tuple, kwargs: dict) -> bool | None:
    """Where a Python-level move sends its tensor: True the host, False the device, None
    not a move (a dtype change, another call). The ways of moving a tensor: ``.cpu()``,
    ``.to(...)`` in each of its forms, ``.type_as(other)`` and ``.type(name)``."""
    if func is torch.Tensor.cpu:
        return True
    if func is torch.Tensor.to:
        device, like, _ = to_target(args, kwargs)
        return None if device is None else means_host(d, device, like)
    if func is torch.Tensor.type_as:
        other = arg(args, kwargs, 1, "other")
        return means_host(d, None, other) if isinstance(other, torch.Tensor) else None
    if func is torch.Tensor.type:
        name = arg(args, kwargs, 1, "dtype")
        if not isinstance(name, str):
            return None  # a torch.dtype, or no argument: the type's name is returned
        return not (isinstance(name, DeviceTypeName) or ".cuda." in name)
    return None


def _move_syncs(d: Any, args: tuple, kwargs: dict, func: Any) -> bool:
    """Whether a move (see ``move_target``) is a copy between host and device that the
    host waits for; ``.to`` may pass ``non_blocking`` by position."""
    target = move_target(d, func, args, kwargs)
    if target is None:
        return False
    if func is torch.Tensor.to:
        non_blocking = to_target(args, kwargs)[2]
    else:
        non_blocking = bool(kwargs.get("non_blocking", False))
    return _blocking_copy(d, args[0], target, non_blocking)


def _blocking_copy(d: Any, src: Any, to_host: bool, non_blocking: bool) -> bool:
    """A copy between host and device that the host waits for: device to host unless
    ``non_blocking`` (a pinned copy filled later), host to device unless ``non_blocking``
    (pageable or not, a blocking H2D copy returns when it is done)."""
    if non_blocking or not isinstance(src, torch.Tensor):
        return False
    return d.on_device(src) == to_host  # device -> host, or host -> device


def _copy_syncs(d: Any, args: tuple, kwargs: dict) -> bool:
    dst, src = args[0], args[1]
    non_blocking = bool(arg(args, kwargs, 2, "non_blocking", False))
    return d.on_device(dst) != d.on_device(src) and not non_blocking


# -- indexing (test_torch.py::test_sync_warning: _ind_get_fn, _ind_put_fn) -------------------


def _host_index(d: Any, index: Any) -> bool:
    """An index tensor in host memory on a device tensor: copied over first, blocking."""
    return any(
        isinstance(i, torch.Tensor) and i.dim() > 0 and not d.on_device(i)
        for i in index_parts(index)
    )


def _number_index(d: Any, index: Any) -> bool:
    """A device tensor the indexing code turns into a Python int: a 0-dim integer tensor
    (aten/src/ATen/TensorIndexing.h, handleDimInMultiDimIndexing: ``tensor.item()``) or a
    slice bound (``__index__``), e.g. ``x[i]`` or ``x[:n]`` with ``i``, ``n`` on the device."""
    for i in index_parts(index):
        bounds = (i.start, i.stop, i.step) if isinstance(i, slice) else (i,)
        for b in bounds:
            if (
                isinstance(b, torch.Tensor)
                and b.dim() == 0
                and not is_mask(b)
                and not b.is_floating_point()
                and d.on_device(b)
            ):
                return True
    return False


def _masked(d: Any, args: tuple, kwargs: dict) -> bool:
    return d.on_device(args[0]) and any(is_mask(i) for i in index_parts(args[1]))


def _host_indexed(d: Any, args: tuple, kwargs: dict) -> bool:
    return d.on_device(args[0]) and _host_index(d, args[1])


def _mask_assign_syncs(d: Any, args: tuple, kwargs: dict) -> int:
    self_, index, value = args[0], args[1], args[2]
    if not d.on_device(self_):
        return 0
    tensors = [i for i in index_parts(index) if isinstance(i, torch.Tensor)]
    if not any(is_mask(i) for i in tensors):
        return 0
    # aten/src/ATen/native/TensorAdvancedIndexing.cpp, _index_put_impl_: a mask that is the
    # only tensor index, with one value in host memory (a Python number, a host tensor),
    # becomes masked_fill_ (canDispatchToMaskedFill, TensorAdvancedIndexingUtils.h: it
    # refuses any other tensor index or a second mask): no read. Otherwise the mask's
    # positions are read back (nonzero, in expandTensors), and a 0-dim host value is first
    # copied to the device, blocking (value.to(self.device())): x[mask, idx] = 1.0.
    host_value = not isinstance(value, torch.Tensor) or not d.on_device(value)
    one_value = not isinstance(value, torch.Tensor) or value.numel() == 1
    if len(tensors) == 1 and host_value and one_value:
        return 0
    scalar_copy = host_value and (not isinstance(value, torch.Tensor) or value.dim() == 0)
    return 1 + int(scalar_copy)


def _copy_forms(label: str, blocking: Check, to_host: Check) -> tuple[Rule, Rule]:
    """A blocking copy, by its direction: to the host, keep it on the device; to the
    device, make it there."""
    close = ")" if label.endswith("(") else ""
    return (
        Rule(
            f"{label}a blocking copy to the host{close}",
            DEFER,
            lambda d, a, k: bool(to_host(d, a, k)) and blocking(d, a, k),
        ),
        Rule(
            f"{label}a blocking copy to the device{close}",
            TO_DEVICE_HINT,
            lambda d, a, k: not to_host(d, a, k) and blocking(d, a, k),
        ),
    )


def _index_forms(assign: bool) -> tuple[Rule, ...]:
    """The ways ``x[index]`` (or ``x[index] = value``) waits, each with its fix."""
    number = "x[i] = value / x[:n] = value" if assign else "x[i] / x[:n]"
    return (
        Rule(
            f"{number} with i or n a device tensor (read as a Python number)",
            "index with a one-element tensor, which stays on the device: "
            + (
                "x[i.reshape(1)] = value"
                if assign
                else "x[i.reshape(1)], or x.index_select(0, i.reshape(1))"
            )
            + "; a slice bound is a length: "
            + NUMBER_HINT,
            lambda d, a, k: _number_index(d, a[1]),
        ),
        Rule(
            "x[mask] = value / x[mask, idx] = ... (boolean-mask assignment)"
            if assign
            else "x[mask] (boolean-mask index)",
            MASK_ASSIGN_HINT if assign else MASK_INDEX_HINT,
            _mask_assign_syncs if assign else _masked,
        ),
        Rule(
            "x[host index]" + (" = value" if assign else "") + " (an index tensor in host memory)",
            HOST_INDEX_HINT,
            _host_indexed,
        ),
    )


# -- functions whose sync depends on their arguments --------------------------------------


def _one_hot_syncs(d: Any, args: tuple, kwargs: dict) -> bool:
    # Without num_classes it reads max() back (test_sync_warning). With it, only the CPU
    # kernel checks the range: a CUDA run does not wait.
    return d.on_device(args[0]) and arg(args, kwargs, 1, "num_classes", -1) < 0


def _cross_entropy_syncs(d: Any, args: tuple, kwargs: dict) -> bool:
    # aten/src/ATen/native/LossNLL.cpp, cross_entropy_loss_label_smoothing: with a class
    # weight and mean reduction it sums weight.gather(target.masked_select(~ignore)), a
    # read of the mask's size. A dispatch mode (like this detector's) makes every tensor
    # "subclass-like" and takes a sync-free branch instead, so the rule is here.
    weight = arg(args, kwargs, 2, "weight")
    smoothing = arg(args, kwargs, 7, "label_smoothing", 0.0)
    reduction = arg(args, kwargs, 6, "reduction", "mean")
    return d.on_device(args[0]) and weight is not None and smoothing > 0 and reduction == "mean"


def _isin_syncs(d: Any, args: tuple, kwargs: dict) -> bool:
    # aten/src/ATen/native/TensorCompare.cpp, isin: a test set of at least
    # 10 * n ** 0.145 elements takes the sorting path, which calls unique (a size read).
    elements, test = args[0], arg(args, kwargs, 1, "test_elements")
    if not (isinstance(test, torch.Tensor) and (d.on_device(elements) or d.on_device(test))):
        return False
    n = elements.numel() if isinstance(elements, torch.Tensor) else 1
    return test.numel() >= int(10.0 * n**0.145)


def _equal_syncs(d: Any, args: tuple, kwargs: dict) -> bool:
    # aten/src/ATen/native/cuda/Equal.cpp, cuda_equal: it answers without reading back when
    # the sizes differ, when there is nothing to compare, and when both are one view of one
    # memory; else eq(a, b).all().item(). (On a GPU machine: equal(x, x) and equal with a
    # longer tensor did not wait; equal(x, x.clone()) did.)
    a, b = args[0], args[1]
    if not (d.on_device(a) or d.on_device(b)) or a.shape != b.shape or a.numel() == 0:
        return False
    same_view = a.is_set_to(b) and a.dtype == b.dtype
    return not (same_view and a.is_neg() == b.is_neg() and a.is_conj() == b.is_conj())


def _tensor_from_data_syncs(d: Any, args: tuple, kwargs: dict) -> bool:
    # torch.tensor(list, device=cuda) builds the tensor on the host and copies it over,
    # blocking (the same for as_tensor/asarray of host data).
    data, device = arg(args, kwargs, 0, "data"), kwargs.get("device")
    if isinstance(data, torch.Tensor):
        return _blocking_copy(d, data, means_host(d, device), False) if device else False
    return device is not None and not means_host(d, device)


def _repeat_interleave_syncs(d: Any, args: tuple, kwargs: dict) -> bool:
    # repeat_interleave(counts), its one-argument form, repeats the indices: counts are
    # the repeats, and the output's length is read back the same way.
    repeats = arg(args, kwargs, 1, "repeats", args[0] if len(args) == 1 else None)
    return (
        isinstance(repeats, torch.Tensor)
        and (d.on_device(args[0]) or d.on_device(repeats))
        and arg(args, kwargs, 3, "output_size") is None
    )


def _new_tensor_syncs(d: Any, args: tuple, kwargs: dict) -> bool:
    # x.new_tensor(data) builds data on the host and copies it to x's device, blocking,
    # like torch.tensor(data, device=x.device); device data is a copy on the device.
    data = arg(args, kwargs, 1, "data")
    device = kwargs.get("device")
    to_device = d.on_device(args[0]) if device is None else not means_host(d, device)
    if isinstance(data, torch.Tensor):
        return _blocking_copy(d, data, not to_device, False)
    return to_device


# -- the tables ----------------------------------------------------------------------------

SCALAR_HINT = "keep it a tensor: log it with self.log, or read it at logging steps"

PYTHON_RULES: dict[Any, Rule] = {
    torch.Tensor.item: Rule("Tensor.item()", LOG_IT, owns=True),
    torch.Tensor.__bool__: Rule(
        "bool(tensor) (if/while/and/or on a tensor)",
        "branch on the device with torch.where, or decide every N steps",
        owns=True,
    ),
    torch.Tensor.__float__: Rule("float(tensor)", SCALAR_HINT, owns=True),
    torch.Tensor.__int__: Rule(
        "int(tensor)",
        "keep it a tensor, or compute the number on the host (from shapes, not values)",
        owns=True,
    ),
    torch.Tensor.__index__: Rule(
        "tensor used as a Python number (__index__)", NUMBER_HINT, owns=True
    ),
    torch.Tensor.__complex__: Rule("complex(tensor)", SCALAR_HINT, owns=True),
    torch.Tensor.__format__: Rule(
        "format(tensor) / f-string",
        "format at logging steps only, or log the tensor with self.log",
        owns=True,
    ),
    torch.Tensor.__repr__: Rule(
        "print/repr/str(tensor)",
        "print at logging steps only, or log the tensor with self.log",
        owns=True,
    ),
    torch.Tensor.tolist: Rule("Tensor.tolist()", DEFER, owns=True),
    torch.Tensor.numpy: Rule("Tensor.numpy()", DEFER, owns=True),
    torch.Tensor.__array__: Rule("np.asarray(tensor)", DEFER, owns=True),
    torch.Tensor.cpu: Rule("Tensor.cpu()", DEFER, owns=True),
    torch.Tensor.to: Rule(
        "Tensor.to",
        "",
        owns=True,
        forms=_copy_forms(
            "Tensor.to (",
            lambda d, a, k: _move_syncs(d, a, k, torch.Tensor.to),
            lambda d, a, k: move_target(d, torch.Tensor.to, a, k) is True,
        ),
    ),
    torch.Tensor.type_as: Rule(
        "Tensor.type_as (a blocking copy between host and device)",
        "create it on the device: torch.randn(n, d, device=x.device, dtype=x.dtype)",
        lambda d, a, k: _move_syncs(d, a, k, torch.Tensor.type_as),
        owns=True,
    ),
    torch.Tensor.type: Rule(
        "Tensor.type (a blocking copy between host and device)",
        "create it on the device (device=x.device), or convert the dtype only: .to(dtype)",
        lambda d, a, k: _move_syncs(d, a, k, torch.Tensor.type),
        owns=True,
    ),
    torch.Tensor.new_tensor: Rule(
        "Tensor.new_tensor(host data) (a blocking copy to the device)",
        "create it on the device (new_full, new_zeros, torch.arange(..., device=x.device)), "
        "or once, outside the step",
        _new_tensor_syncs,
        owns=True,
    ),
    torch.Tensor.copy_: Rule(
        "Tensor.copy_ (a blocking copy between host and device)",
        "pass non_blocking=True (from pinned memory), or keep both on one side",
        _copy_syncs,
        owns=True,
    ),
    torch.Tensor.__getitem__: Rule("x[index]", "", owns=True, forms=_index_forms(False)),
    torch.Tensor.__setitem__: Rule("x[index] = value", "", owns=True, forms=_index_forms(True)),
    F.one_hot: Rule(
        "one_hot without num_classes",
        "pass num_classes= (known on the host)",
        _one_hot_syncs,
        owns=True,
    ),
    F.cross_entropy: Rule(
        "cross_entropy with weight and label_smoothing (mean reduction)",
        "reduction='sum', divided by the targets' weights: weight[target].sum() (with "
        "ignore_index: (weight[target.clamp_min(0)] * (target != ignore_index)).sum())",
        _cross_entropy_syncs,
        owns=True,
    ),
    torch.isin: Rule(
        "isin with a large test set (sorting path: unique)",
        "compare elementwise, (x[..., None] == test).any(-1), or for values in [0, n) look up "
        "a table made on the device: torch.zeros(n, dtype=torch.bool, "
        "device=x.device).scatter_(0, test, True)[x]",
        _isin_syncs,
        owns=True,
    ),
    torch.repeat_interleave: Rule(
        "repeat_interleave with tensor repeats, without output_size",
        "pass output_size= (the total length, known on the host)",
        _repeat_interleave_syncs,
        owns=True,
    ),
}
for _factory in (torch.tensor, torch.as_tensor, torch.asarray):
    PYTHON_RULES[_factory] = Rule(
        f"torch.{_factory.__name__}(host data, device=...) (a blocking copy to the device)",
        "create it on the device (torch.full/arange/zeros with device=), or once, outside the step",
        _tensor_from_data_syncs,
        owns=True,
    )
PYTHON_RULES[torch.Tensor.repeat_interleave] = PYTHON_RULES[torch.repeat_interleave]

ATEN_RULES: dict[Any, Rule] = {}


def _aten(
    names: tuple[str, ...],
    label: str,
    hint: str,
    syncs: Check | None = None,
    forms: tuple[Rule, ...] = (),
) -> None:
    for name in names:
        packet = getattr(aten, name, None)
        if packet is not None:
            ATEN_RULES[packet] = Rule(label, hint, syncs, forms=forms)


_aten(
    ("_local_scalar_dense",),
    "scalar read (.item(), float(t), bool(t), a tensor as a number)",
    NUMBER_HINT,
)
_aten(
    ("nonzero",),
    "nonzero / argwhere / torch.where(cond)",
    "use torch.nonzero_static(x, size=...) or three-argument torch.where",
)
_aten(
    ("index", "_unsafe_index"),
    "x[mask] (boolean-mask index)",
    MASK_INDEX_HINT,
    lambda d, a, k: d.on_device(a[0]) and any(is_mask(i) for i in a[1] or ()),
)
_aten(
    ("index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"),
    "x[mask] = tensor (boolean-mask assignment)",
    MASK_ASSIGN_HINT,
    lambda d, a, k: (
        d.on_device(a[0])
        and any(is_mask(i) for i in a[1] or ())
        and (bool(arg(a, k, 3, "accumulate", False)) or d.on_device(a[2]) or a[2].dim() > 0)
    ),
)
_aten(
    ("masked_select",),
    "masked_select",
    "use torch.where(mask, x, 0), or nonzero_static(size=...) + gather",
)
_aten(
    ("masked_fill", "masked_fill_"),
    "masked_fill with a device tensor value",
    "pass the fill value as a Python number, or use torch.where(mask, value, x)",
    lambda d, a, k: len(a) > 2 and d.on_device(a[0]) and d.on_device(a[2]),
)
_aten(
    ("_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive"),
    "unique",
    # torch.unique takes no size: its output's length is read back whatever the arguments
    "compute it in the DataLoader (host side), or, for values known to lie in [0, n), mark "
    "them on the device: torch.zeros(n, dtype=torch.bool, device=x.device).scatter_(0, x, True)",
)
_aten(
    ("repeat_interleave",),
    "repeat_interleave without output_size",
    "pass output_size= (the total length, known on the host)",
    lambda d, a, k: d.on_device(a[0]) and k.get("output_size") is None,
)
_aten(
    ("bincount",),
    "bincount",
    "count with a size known on the host: torch.zeros(n, dtype=torch.long, "
    "device=x.device).scatter_add_(0, x, torch.ones_like(x))",
)
_aten(
    ("histc",),
    "histc without min/max",
    "pass min= and max= explicitly",
    lambda d, a, k: d.on_device(a[0]) and arg(a, k, 2, "min", 0) == arg(a, k, 3, "max", 0),
)
_aten(
    ("equal",),
    "torch.equal / torch.allclose",
    "compare on the device (torch.isclose(a, b).all()) and read it at logging steps",
    _equal_syncs,
)
_aten(
    ("allclose",),  # isclose(...).all().item(), with no shortcut
    "torch.equal / torch.allclose",
    "compare on the device (torch.isclose(a, b).all()) and read it at logging steps",
)
# No rule for multinomial: on CUDA its check of the probabilities is an _assert_async, no
# read (measured on a GPU machine with torch 2.11; the project's range starts there). Nor
# for combinations: a composite op whose own decomposition the aten layer sees, a
# masked_select (two syncs) on torch 2.11 and nonzero_static (none) on 2.14.
# The docs of linalg.eigh, eigvalsh, eig, svd, svdvals, inv, cholesky, solve: "When
# inputs are on a CUDA device, this function synchronizes that device with the CPU".
_aten(
    ("_linalg_check_errors",),
    "linalg error check (inv, cholesky, solve, ...)",
    "use the _ex form (torch.linalg.inv_ex, cholesky_ex, solve_ex), which returns info on "
    "the device; check info at logging steps",
)
_aten(
    ("_linalg_eigh", "_linalg_svd", "linalg_eig"),
    "linalg.eigh / svd / eig (an error check on the host)",
    "no sync-free form: PyTorch's eigh, svd and eig always wait for their check on a GPU; "
    "call them at logging steps, or outside the training step",
)
_aten(
    ("_ctc_loss", "ctc_loss"),
    "ctc_loss with length tensors",
    "pass input and target lengths as host tensors or lists",
    lambda d, a, k: any(d.on_device(x) for x in a[2:4]),
)
_aten(
    ("_to_copy",),
    "a blocking copy between host and device",
    "",
    forms=_copy_forms(
        "",
        lambda d, a, k: (
            k.get("device") is not None
            and _blocking_copy(d, a[0], means_host(d, k["device"]), bool(k.get("non_blocking")))
        ),
        lambda d, a, k: means_host(d, k.get("device")),
    ),
)
_aten(
    ("copy_",),
    "a blocking copy between host and device",
    "",
    forms=_copy_forms("", _copy_syncs, lambda d, a, k: not d.on_device(a[0])),
)

# Forward ops whose backward syncs; the backward is attributed to the forward line.
# torch/csrc/autograd/FunctionsManual.cpp: cumprod_backward reads (input == 0).any() and
# prod_backward finds the zeros with nonzero() (or sums them to a host number), unless the
# tensors are subclass-like, as under a dispatch mode; index_backward and
# masked_scatter_backward index with the mask again.
BACKWARD_RULES: dict[Any, Rule] = {
    torch.Tensor.__getitem__: Rule(
        "backward of x[mask] (boolean-mask index)",
        "index with precomputed integer indices (index_select) or use torch.where(mask, x, 0)",
        lambda d, a, k: d.on_device(a[0]) and any(is_mask(i) for i in index_parts(a[1])),
    ),
    torch.cumprod: Rule(
        "backward of cumprod (reads whether the input has zeros)",
        "for a positive input, exp(cumsum(log(x))) (clamp_min(eps) first if it may reach 0); "
        "or cumprod of a detached input where no gradient is needed",
        lambda d, a, k: (
            d.on_device(a[0])
            and a[0].numel() > 1
            and a[0].size(arg(a, k, 1, "dim")) > 1
            and torch.is_grad_enabled()
        ),
    ),
    torch.Tensor.masked_scatter: Rule(
        "backward of masked_scatter (masked_select of the gradient)",
        "use torch.where(mask, source_expanded, x) with a source of the same shape",
        lambda d, a, k: d.on_device(a[0]) and torch.is_grad_enabled(),
    ),
}
BACKWARD_RULES[torch.prod] = BACKWARD_RULES[torch.Tensor.prod] = Rule(
    "backward of prod (finds the zeros of the input)",
    "for a positive input, exp(sum(log(x))) (clamp_min(eps) first if it may reach 0); or "
    "prod of a detached input where no gradient is needed",
    lambda d, a, k: d.on_device(a[0]) and a[0].dim() > 0 and torch.is_grad_enabled(),
)
BACKWARD_RULES[torch.Tensor.cumprod] = BACKWARD_RULES[torch.cumprod]
BACKWARD_RULES[torch.masked_scatter] = BACKWARD_RULES[torch.Tensor.masked_scatter]

# Lightning's own reads, recognised by a function in the chain of a sync event (first
# match wins), with the fix the report gives; callbacks.SyncPointDetector passes them as
# its detector's chain_hints. Matched by name (nothing here imports Lightning). Private:
# _TrainingEpochLoop._broadcast_sigterm_tensor (2.5.2 to 2.6), _LoggerConnector.on_batch_end,
# .progress_bar_metrics and .update_train_step_metrics (2.0 to 2.6); public:
# Trainer.callback_metrics. Pinned by tests/contracts/test_lightning_compat.py.
LIGHTNING_READS: tuple[tuple[str, str], ...] = (
    (
        "_broadcast_sigterm_tensor",
        "Lightning's per-step DDP SIGTERM check: add gpu_busy.callbacks.StopOnSignal "
        "(on in the default config), which checks every N steps instead",
    ),
    (
        "in on_batch_end",
        "drop prog_bar=True from this self.log: Lightning converts a prog_bar value with an "
        ".item() after every step; LoggingStepProgressBar shows logged values at logging "
        "steps without a wait",
    ),
    (
        "progress_bar_metrics",
        "reading trainer.progress_bar_metrics converts the prog_bar values to numbers (one "
        "copy under gpu_busy.callbacks.LoggingStepProgressBar, an .item() each without it): "
        "read it at logging steps only; for a bar, use LoggingStepProgressBar",
    ),
    (
        "update_train_step_metrics",
        "Lightning writes the logged metrics to the loggers (logging steps only): expected; "
        "a larger log_every_n_steps does it less often",
    ),
    (
        "callback_metrics",
        "trainer.callback_metrics converts logged tensors to numbers: read it at logging "
        "steps or at epoch end",
    ),
)


# Reads a library makes on the caller's behalf, by the function in the chain that makes it
# (``SyncEvent.chain``), with the fix at the caller's side; first match wins.
LIBRARY_READS: tuple[tuple[str, str], ...] = (
    (
        # torch/nn/modules/transformer.py, _detect_is_causal_mask: without a hint, it
        # compares the mask with a causal one (torch.equal) on every forward.
        "in _detect_is_causal_mask",
        "tell nn.Transformer* the mask is causal: pass tgt_is_causal=True (decoder) or "
        "is_causal=True (encoder) with the causal mask, and it compares nothing",
    ),
    # torchmetrics (1.x): the fixes are the metric's own arguments. Held, metric by metric,
    # by tests/syncs/test_torchmetrics.py, and listed in README ("A sync-free step").
    (
        # utilities/data.py, _bincount: torch.bincount sizes its output from the input's
        # max on the host; stat_scores.py's update calls it for every average but "micro",
        # and the confusion matrices call it always.
        "in _bincount",
        'torchmetrics counts classes with a bincount sized on the host (average="macro", its '
        'default, and confusion matrices): average="micro", validate_args=False has no sync '
        "but is another metric (micro weighs every sample, macro every class equally); keep "
        "a macro metric to validation, where a sync per batch costs little",
    ),
    (
        # functional/classification/stat_scores.py, _{binary,multiclass,multilabel}_stat_
        # scores_tensor_validation: torch.unique of the inputs and `if` on their values.
        "_stat_scores_tensor_validation",
        "torchmetrics checks its inputs on the host at every update: validate_args=False "
        "turns the checks off and leaves the metric as it is",
    ),
    (
        # collections.py, MetricCollection._merge_compute_groups (via _equal_metric_states,
        # utilities/data.py allclose): with compute_groups=True, its default, the first
        # update compares every pair of metrics' states on the host; a list of groups is
        # taken as given (_init_compute_groups) and nothing is compared.
        "in _merge_compute_groups",
        "torchmetrics' MetricCollection compares its metrics' states on the host at its first "
        "update, to find which can share them (compute_groups=True, its default): pass "
        'compute_groups=False, or name the groups yourself (compute_groups=[["acc", "f1"]], '
        "metrics of one family with the same arguments), and nothing is compared",
    ),
    (
        # aggregation.py, BaseAggregator._cast_and_nan_check_input: `if nans.any()` at every
        # update unless nan_strategy="disable".
        "in _cast_and_nan_check_input",
        "torchmetrics' MeanMetric/SumMetric/... look for NaN on the host at every update: "
        'nan_strategy="disable" skips the check (a NaN then reaches the result, as in a '
        "plain mean)",
    ),
    (
        # torch/amp/grad_scaler.py, GradScaler._maybe_opt_step: it skips the optimizer step
        # when found_inf, a device tensor, says so: `if not sum(v.item() ...)`.
        "torch/amp/grad_scaler.py",
        "GradScaler reads whether the float16 gradients overflowed at every optimizer step: "
        'no sync-free form with float16; precision="bf16-mixed" needs no scaler (bfloat16 has '
        "float32's range) where the GPU has it (Ampere and later)",
    ),
    (
        # torch/distributions/distribution.py (torch 2.11-2.14): __init__ and
        # _validate_sample check every argument and sample against its constraint with
        # `if not torch._is_all_true(valid)`, a read of a device tensor, when validate_args
        # is on (the default outside python -O).
        "torch/distributions/distribution.py",
        "torch.distributions checks its arguments and samples on the host (validate_args): "
        "pass validate_args=False to the distribution, or call "
        "torch.distributions.Distribution.set_default_validate_args(False) once, for code "
        "whose inputs you trust",
    ),
)

# torch/csrc/distributed/c10d/reducer.cpp: under find_unused_parameters=True (and no static
# graph) the reducer all-reduces its map of used parameters on the device, copies it back
# to its host map once per backward (blocking), then reads the host map per parameter.
DDP_USED_MAP = (
    "DDP's reducer: the used-parameter map copied to the host (find_unused_parameters=True)",
    "pass find_unused_parameters=False if every parameter gets a gradient every step, or "
    "static_graph=True if the same ones go unused every step: DDP then keeps no map",
)

# Calls that make a tensor: without device= (or with the string "cpu") it is on the host.
FACTORIES = frozenset(
    getattr(torch, name)
    for name in (
        "tensor", "as_tensor", "asarray", "zeros", "ones", "empty", "full", "arange",
        "linspace", "logspace", "rand", "randn", "randint", "randperm", "eye", "from_numpy",
        "scalar_tensor", "empty_strided", "tril_indices", "triu_indices",
    )
    if hasattr(torch, name)
)  # fmt: skip


# What a library's GPU side of a branch on the device does, by (its file after
# site-packages, the function), where that side makes no sync: the CPU side's read is then
# "no sync on a GPU" (gpu_busy.syncs.device_branches finds the branch and both sides' lines).
GPU_BRANCHES: dict[tuple[str, str], str] = {
    # torchmetrics 1.9.0 utilities/compute.py, normalize_logits_if_needed: on a CPU tensor
    # `if not torch.all((tensor >= 0) * (tensor <= 1))` (lines 232-235, a read); on any
    # other, `torch.where(condition, sigmoid, tensor)` (lines 238-242), no read.
    ("torchmetrics/utilities/compute.py", "normalize_logits_if_needed"): (
        "applies sigmoid or softmax with torch.where, on the device"
    ),
}
