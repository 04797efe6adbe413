"""Which calls make the host wait for the GPU, as PyTorch itself says, for the detector to
be held to: on the CPU (its simulation) in tests/syncs/test_sync_cases.py, and on CUDA against
``torch.cuda.set_sync_debug_mode("error")`` in tests/gpu/test_gpu.py.

Each case names its source: PyTorch's own list in ``test/test_torch.py::test_sync_warning``
(``expect_sync`` / ``expect_no_sync``), the kernels that read a value back, or the docs'
"synchronizes" notes. A case gets the tensors of ``Tensors``: device memory made before
watching (a model's parameters, a batch after the transfer), and host memory where it says
so (``host_*``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class Tensors:
    """The inputs of every case, on ``device``; ``host_*`` ones on the CPU."""

    def __init__(self, device: str) -> None:
        g = torch.Generator().manual_seed(0)
        self.device = torch.device(device)
        on = {"device": self.device}
        self.x = torch.rand(4, generator=g).to(**on)
        self.y = torch.rand((), generator=g).to(**on)
        self.ind = torch.randint(4, (3,), generator=g).to(**on)
        self.repeats = torch.full((1,), 2, **on)
        self.mask = torch.tensor([True, False, True, False], **on)
        self.grid = torch.rand(4, 3, generator=g).to(**on)
        self.cols = torch.tensor([0, 2], **on)  # one per row the mask keeps
        self.sym = (lambda a: a @ a.T)(torch.randn(3, 3, generator=g)).to(**on)
        self.logits = torch.randn(6, 3, generator=g).to(**on)
        self.labels = torch.tensor([0, 1, 2, 0, 1, 2], **on)
        self.weight = torch.tensor([1.0, 2.0, 0.5], **on)
        self.w = torch.randn(4, generator=g).to(**on).requires_grad_()
        self.many = torch.arange(400, **on)
        self.i = torch.tensor(2, **on)  # 0-dim integers: an index, a slice bound
        self.n = torch.tensor(3, **on)
        # host memory: made on the CPU
        self.host_ind = self.ind.cpu().clone()
        self.host_scalar = torch.tensor(0.5)

    def host(self) -> list[torch.Tensor]:
        return [self.host_ind, self.host_scalar]


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[Tensors], object]
    syncs: int  # host waits a GPU run makes
    source: str


def _set(x: torch.Tensor, index, value) -> torch.Tensor:
    x = x.clone()
    x[index] = value
    return x


def _branch(t: Tensors):
    return t.y if t.y else 2 * t.y


def _adam_steps(t: Tensors, cls=torch.optim.Adam):
    w = torch.nn.Parameter(t.w.detach().clone())
    opt = cls([w], lr=0.1)
    for _ in range(2):
        (w * t.x).sum().backward()
        opt.step()
        opt.zero_grad()


def _clip(t: Tensors):
    w = torch.nn.Parameter(t.w.detach().clone())
    (w * t.x).sum().backward()
    torch.nn.utils.clip_grad_norm_([w], 1.0)


def _scaler(t: Tensors):
    w = torch.nn.Parameter(t.w.detach().clone())
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler(t.device.type)
    scaler.scale((w * t.x).sum()).backward()
    scaler.step(opt)  # reads found_inf back before stepping
    scaler.update()


def _host_mask_to_device(t: Tensors):
    causal = torch.triu(torch.ones(4, 4), diagonal=1).bool()  # made on the host
    return t.x.masked_fill(causal.to(t.x.device)[0], 0.0)


def _state_moved_with_its_owner(t: Tensors):
    # A state made on the host in the step (as Lightning's logged-metric states are) and
    # moved with its module: one blocking copy. From then on it is device memory: a copy of
    # it that goes .to() the device again (torchmetrics' reset of its defaults) is device
    # to device.
    owner = torch.nn.Module()
    owner.register_buffer("total", torch.zeros(()))
    owner.to(t.device)
    return owner.total.detach().clone().to(t.device)


def _backward(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Tensors], None]:
    def run(t: Tensors) -> None:
        w = t.w.detach().clone().requires_grad_()
        fn(w).sum().backward()

    return run


TTS = "test/test_torch.py::test_sync_warning"
CASES = [
    # PyTorch's own lists (expect_no_sync / expect_sync)
    Case("mask_assign_python_number", lambda t: _set(t.x, t.mask, 1.0), 0, TTS),
    Case("index_assign_device_value", lambda t: _set(t.x, t.ind, t.y), 0, TTS),
    Case("index_get_device_index", lambda t: t.x[t.ind], 0, TTS),
    Case("one_hot_with_num_classes", lambda t: F.one_hot(t.ind, num_classes=4), 0, TTS),
    Case("randperm_on_device", lambda t: torch.randperm(200, device=t.device), 0, TTS),
    Case(
        "repeat_interleave_int_output_size",
        lambda t: torch.repeat_interleave(t.x, 2, output_size=8),
        0,
        TTS,
    ),
    Case(
        "repeat_interleave_tensor_output_size",
        lambda t: torch.repeat_interleave(t.x, t.repeats, output_size=8),
        0,
        TTS,
    ),
    Case("any_of_a_scalar", lambda t: torch.any(t.y), 0, TTS),
    Case("mask_assign_device_value", lambda t: _set(t.x, t.mask, t.y), 1, TTS),
    Case("index_assign_host_index", lambda t: _set(t.x, t.host_ind, t.y), 1, TTS),
    Case("mask_index", lambda t: t.x[t.mask], 1, TTS),
    Case(
        "mask_and_index_assign_python_number",
        lambda t: _set(t.grid, (t.mask, t.cols), 1.0),
        2,
        "aten/src/ATen/native/TensorAdvancedIndexing.cpp, _index_put_impl_: "
        "canDispatchToMaskedFill refuses a second index, so the number is copied to the "
        "device (blocking) and the mask read back (nonzero); torchvision's RetinaNet loss",
    ),
    Case("index_get_host_index", lambda t: t.x[t.host_ind], 1, TTS),
    Case("nonzero", lambda t: t.x.nonzero(), 1, TTS),
    Case("if_tensor", _branch, 1, TTS),
    Case("one_hot_without_num_classes", lambda t: F.one_hot(t.ind), 1, TTS),
    Case("repeat_interleave_tensor", lambda t: torch.repeat_interleave(t.x, t.repeats), 1, TTS),
    # Reads of a value (Tensor.item and the Python conversions: _local_scalar_dense)
    Case("item", lambda t: t.x.sum().item(), 1, "aten/src/ATen/native/Scalar.cpp"),
    Case("float", lambda t: float(t.x.sum()), 1, "aten/src/ATen/native/Scalar.cpp"),
    Case("int", lambda t: int(t.x.sum()), 1, "aten/src/ATen/native/Scalar.cpp"),
    Case("fstring", lambda t: f"{t.x.sum():.2f}", 1, "torch/_tensor.py __format__"),
    Case("repr", lambda t: repr(t.x), 1, "torch/_tensor_str.py"),
    Case("tolist", lambda t: t.x.tolist(), 1, "torch/csrc/utils/tensor_list.cpp"),
    Case("cpu", lambda t: t.x.cpu(), 1, "copy_ to the host, blocking"),
    Case("to_cpu_string", lambda t: t.x.to("cpu"), 1, "copy_ to the host, blocking"),
    Case(
        "to_cpu_non_blocking",
        lambda t: t.x.to("cpu", non_blocking=True),
        0,
        "copy to pinned memory",
    ),
    Case("to_device_same", lambda t: t.x.to(t.x.device), 0, "no copy"),
    Case("to_dtype", lambda t: t.x.to(torch.float64, copy=True), 0, "a copy on the device"),
    Case("cpu_then_item", lambda t: t.x.sum().cpu().item(), 1, "one copy; the read is host"),
    Case("host_scalar_item", lambda t: t.host_scalar.item(), 0, "host memory: no device"),
    Case(
        "host_tensor_made_in_step",
        lambda t: torch.tensor([1.0, 2.0]).sum().item(),
        0,
        "host memory: no device",
    ),
    Case("arange_of_a_tensor", lambda t: torch.arange(t.x.sum()), 1, "a size read"),
    Case("arange_on_device", lambda t: torch.arange(4, device=t.device), 0, "a factory"),
    # Copies from the host (copy_ with non_blocking=False, from pageable memory)
    Case("host_mask_to_device", _host_mask_to_device, 1, "copy_ host to device, blocking"),
    Case(
        "tensor_from_list_on_device",
        lambda t: torch.tensor([1.0, 2.0], device=t.device),
        1,
        "torch/csrc/utils/tensor_new.cpp: built on the host, copied over",
    ),
    Case(
        "host_to_device_non_blocking",
        lambda t: t.host_scalar.to(t.device, non_blocking=True),
        0,
        "an async copy",
    ),
    # Every Python-level way of moving a host tensor to the device copies it, blocking
    Case(
        "type_as_a_device_tensor",
        lambda t: torch.randn(3).type_as(t.x),
        1,
        "aten/src/ATen/native/TensorConversions.cpp: type_as is to(other.options())",
    ),
    Case(
        "type_of_a_device_type_name",
        lambda t: torch.ones(3).type(t.x.type()),
        1,
        "torch/csrc/utils/tensor_types.cpp: a cuda type name moves the tensor",
    ),
    Case("type_to_a_dtype", lambda t: t.x.type(torch.float64), 0, "a cast on the device"),
    Case(
        "new_tensor_from_a_list",
        lambda t: t.x.new_tensor([1.0, 2.0]),
        1,
        "torch/csrc/utils/tensor_new.cpp: built on the host, copied to x's device",
    ),
    Case(
        "as_tensor_on_device",
        lambda t: torch.as_tensor([1.0, 2.0], device=t.device),
        1,
        "torch/csrc/utils/tensor_new.cpp: built on the host, copied over",
    ),
    Case(
        "copy_into_a_device_tensor",
        lambda t: t.x.clone().copy_(torch.ones(4)),
        1,
        "aten/src/ATen/native/cuda/Copy.cu: a blocking host-to-device copy",
    ),
    Case(
        "state_moved_with_its_owner",
        _state_moved_with_its_owner,
        1,
        "torch/nn/modules/module.py: Module.to copies each parameter; then device memory",
    ),
    # Python numbers PyTorch's C++ indexing reads from a device scalar
    Case(
        "index_with_a_device_scalar",
        lambda t: t.x[t.i],
        1,
        "aten/src/ATen/TensorIndexing.h: handleDimInMultiDimIndexing, tensor.item()",
    ),
    Case(
        "slice_with_a_device_bound",
        lambda t: t.x[: t.n],
        1,
        "torch/csrc/autograd/python_variable_indexing.cpp: the bound's __index__",
    ),
    Case(
        "assign_at_a_device_scalar",
        lambda t: _set(t.x, t.i, 1.0),
        1,
        "aten/src/ATen/TensorIndexing.h: the index's item(); the value is filled",
    ),
    Case(
        "repeat_interleave_of_counts",
        lambda t: torch.repeat_interleave(t.repeats),
        1,
        "aten/src/ATen/native/Repeat.cpp: the output's length read back",
    ),
    # Sizes that depend on values
    Case("masked_select", lambda t: t.x.masked_select(t.mask), 1, "a size read"),
    Case("where_one_argument", lambda t: torch.where(t.mask), 1, "nonzero"),
    Case("where_three_arguments", lambda t: torch.where(t.mask, t.x, 0.0), 0, "elementwise"),
    Case("nonzero_static", lambda t: torch.nonzero_static(t.mask, size=4), 0, "a fixed size"),
    Case("unique", lambda t: torch.unique(t.ind), 1, "a size read"),
    Case("bincount", lambda t: torch.bincount(t.ind), 1, "a size read (max)"),
    Case("histc_with_range", lambda t: torch.histc(t.x, 4, min=0, max=1), 0, "known range"),
    Case("equal", lambda t: torch.equal(t.x, t.x.clone()), 1, "returns a bool"),
    # aten/src/ATen/native/cuda/Equal.cpp: answered without a read (seen on a GPU machine)
    Case("equal_to_itself", lambda t: torch.equal(t.x, t.x), 0, "cuda_equal: one view"),
    Case("equal_other_sizes", lambda t: torch.equal(t.x, t.many), 0, "cuda_equal: sizes"),
    Case(
        "isin_large_test_set",
        lambda t: torch.isin(t.ind, t.many),
        1,
        "aten/src/ATen/native/TensorCompare.cpp: the sorting path calls unique",
    ),
    Case(
        "isin_small_test_set",
        lambda t: torch.isin(t.many, t.ind),
        0,
        "aten/src/ATen/native/TensorCompare.cpp: the elementwise path",
    ),
    # Error checks of linalg (docs: "this function synchronizes that device with the CPU")
    Case("linalg_eigh", lambda t: torch.linalg.eigh(t.sym), 1, "docs of torch.linalg.eigh"),
    Case("linalg_svd", lambda t: torch.linalg.svd(t.sym), 1, "docs of torch.linalg.svd"),
    Case("linalg_inv", lambda t: torch.linalg.inv(t.sym), 1, "docs of torch.linalg.inv"),
    Case("linalg_inv_ex", lambda t: torch.linalg.inv_ex(t.sym), 0, "docs: no error check"),
    # Losses
    Case("cross_entropy", lambda t: F.cross_entropy(t.logits, t.labels), 0, "no read"),
    Case(
        "cross_entropy_weight_label_smoothing",
        lambda t: F.cross_entropy(t.logits, t.labels, weight=t.weight, label_smoothing=0.1),
        1,
        "aten/src/ATen/native/LossNLL.cpp: masked_select of the targets",
    ),
    Case(
        "cross_entropy_weight",
        lambda t: F.cross_entropy(t.logits, t.labels, weight=t.weight),
        0,
        "nll_loss with a weight: no read",
    ),
    # Backward
    Case(
        "backward_of_mask_index",
        _backward(lambda w: w[w > 0]),
        2,
        "forward x[mask] and its index_put backward",
    ),
    Case(
        "backward_of_cumprod",
        _backward(lambda w: torch.cumprod(w, 0)),
        1,
        "torch/csrc/autograd/FunctionsManual.cpp: cumprod_backward reads (x == 0).any()",
    ),
    Case(
        "backward_of_prod",
        _backward(lambda w: torch.prod(w).reshape(1)),
        1,
        "torch/csrc/autograd/FunctionsManual.cpp: prod_backward's nonzero()",
    ),
    Case(
        "backward_of_prod_over_a_dim",
        _backward(lambda w: w.reshape(2, 2).prod(1)),
        1,
        "torch/csrc/autograd/FunctionsManual.cpp: prod_backward counts the zeros",
    ),
    Case("backward_of_matmul", _backward(lambda w: w * w), 0, "no read"),
    # Optimizers and training utilities
    Case("adam_steps", _adam_steps, 0, "torch/optim/adam.py: the step counter is on the host"),
    Case(
        "adamw_steps",
        lambda t: _adam_steps(t, torch.optim.AdamW),
        0,
        "torch/optim/adamw.py: the step counter is on the host",
    ),
    Case("clip_grad_norm", _clip, 0, "torch/nn/utils/clip_grad.py: device-side scaling"),
    Case("grad_scaler_step", _scaler, 1, "torch/amp/grad_scaler.py: found_inf .item()"),
]
