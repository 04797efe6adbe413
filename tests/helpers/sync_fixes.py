"""Every fix the sync report prints, followed as printed: for each rule of
``gpu_busy.syncs.rules``, a call that triggers it (``before``) and the same work written as
its fix says (``after``), which must not sync. ``says`` is the part of the printed fix that
``after`` follows (one per site where ``before`` syncs at several); a fix that says there
is no sync-free form has no ``after``. Each row of ``rules.LIBRARY_READS`` is followed the
same way, with the library's own setting.

Held on the CPU by tests/syncs/test_sync_fixes.py (the simulation) and on CUDA by
tests/gpu/test_gpu.py (``torch.cuda.set_sync_debug_mode("error")``). The fixes that need a
Lightning fit (``self.log``, "at logging steps") are followed in
tests/whole/test_fixes_walked.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from tests.helpers.sync_cases import Tensors, _backward, _scaler, _set


@dataclass(frozen=True)
class Fix:
    name: str
    says: str | tuple[str, ...]  # each in a fix printed for ``before``, covering them all
    before: Callable[[Tensors], object]
    after: Callable[[Tensors], object] | None  # None: the fix says no sync-free form exists


class FixTensors(Tensors):
    """``Tensors`` and what a module would hold on the device before the step."""

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.mean = MeanMetric(nan_strategy="disable").to(self.device)
        self.source = torch.arange(4.0).to(self.device)
        self.positive = self.w.detach().abs().add(0.5).requires_grad_()
        # x[mask, cols] = v with one column per kept row; the column of every row, kept or
        # not, is what folds it into the mask
        self.row_cols = torch.tensor([0, 0, 2, 0], device=self.device)
        self.metrics = {
            name: metric.to(self.device)
            for name, metric in {
                "accuracy": MulticlassAccuracy(3),
                "accuracy_fixed": MulticlassAccuracy(3, average="micro", validate_args=False),
                "mean": MeanMetric(),
                "collection": _collection(),
                "collection_fixed": _collection(compute_groups=False),
            }.items()
        }
        self.encoder = torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(4, 1, 8, dropout=0.0, batch_first=True),
            1,
            enable_nested_tensor=False,
        ).to(self.device)
        self.causal = torch.nn.Transformer.generate_square_subsequent_mask(4, device=self.device)
        self.sequence = torch.rand(1, 4, 4, generator=torch.Generator().manual_seed(0)).to(
            self.device
        )


def _collection(**settings) -> MetricCollection:
    return MetricCollection(
        {
            "acc": MulticlassAccuracy(3, average="micro", validate_args=False),
            "f1": MulticlassF1Score(3, average="micro", validate_args=False),
        },
        **settings,
    )


def _normal(t: FixTensors, **settings) -> torch.distributions.Normal:
    return torch.distributions.Normal(t.x, t.x.abs() + 0.1, **settings)


def _positive_backward(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    def run(t: FixTensors) -> None:
        fn(t.positive).sum().backward()

    return run


def _buffer_made(on_device: bool) -> Callable[[Tensors], torch.Tensor]:
    def run(t: Tensors) -> torch.Tensor:
        owner = torch.nn.Module()
        zero = torch.zeros((), device=t.device) if on_device else torch.zeros(())
        owner.register_buffer("total", zero)
        return owner.to(t.device).total

    return run


def _counts(t: Tensors) -> torch.Tensor:
    x = t.ind
    return torch.zeros(4, dtype=torch.long, device=x.device).scatter_add_(0, x, torch.ones_like(x))


def _weighted_smoothed(t: Tensors) -> torch.Tensor:
    total = F.cross_entropy(
        t.logits, t.labels, weight=t.weight, label_smoothing=0.1, reduction="sum"
    )
    return total / t.weight[t.labels].sum()


FIXES = [
    Fix("item", "MeanMetric(nan_strategy=\"disable\")",
        lambda t: t.x.sum().item(), lambda t: t.mean.update(t.x.sum())),
    Fix("bool", "branch on the device with torch.where",
        lambda t: t.y if t.y else 2 * t.y, lambda t: torch.where(t.y != 0, t.y, 2 * t.y)),
    Fix("float", "keep it a tensor", lambda t: float(t.x.sum()), lambda t: t.x.sum()),
    Fix("int", "keep it a tensor", lambda t: int(t.x.sum()), lambda t: t.x.sum().long()),
    Fix("complex", "keep it a tensor",
        lambda t: complex(t.x.sum()), lambda t: t.x.sum().to(torch.complex64)),
    Fix("index_of_a_range", "a fixed upper bound and a mask",
        lambda t: range(t.ind[0]), lambda t: torch.arange(4, device=t.x.device) < t.ind[0]),
    Fix("number_read_by_an_op", "a fixed upper bound and a mask",
        lambda t: torch.arange(t.n), lambda t: torch.arange(8, device=t.x.device) < t.n),
    Fix("cpu", "keep it on the device", lambda t: t.x.cpu() * 2, lambda t: t.x * 2),
    Fix("tolist", "keep it on the device", lambda t: t.x.tolist(), lambda t: t.x),
    Fix("numpy", "keep it on the device", lambda t: t.x.numpy(), lambda t: t.x),
    Fix("to_the_host", "keep it on the device", lambda t: t.x.to("cpu"), lambda t: t.x),
    Fix("count_after_keeping_it_on_the_device", "scatter_add_(0, x, torch.ones_like(x))",
        lambda t: torch.bincount(t.ind, minlength=4), _counts),
    Fix("to_the_device", "create it on the device (device=x.device)",
        lambda t: torch.triu(torch.ones(4, 4), 1).to(t.x.device),
        lambda t: torch.triu(torch.ones(4, 4, device=t.x.device), 1)),
    Fix("module_state_moved", "create it on the device (device=x.device)",
        _buffer_made(False), _buffer_made(True)),
    Fix("type_as", "torch.randn(n, d, device=x.device, dtype=x.dtype)",
        lambda t: torch.randn(3, 2).type_as(t.x),
        lambda t: torch.randn(3, 2, device=t.x.device, dtype=t.x.dtype)),
    Fix("type", "create it on the device (device=x.device)",
        lambda t: torch.ones(3).type(t.x.type()), lambda t: torch.ones(3, device=t.x.device)),
    Fix("new_tensor", "new_full", lambda t: t.x.new_tensor([1.0, 1.0]),
        lambda t: t.x.new_full((2,), 1.0)),
    Fix("tensor_of_host_data", "torch.full/arange/zeros with device=",
        lambda t: torch.tensor([0.0, 1.0, 2.0], device=t.device),
        lambda t: torch.arange(3.0, device=t.device)),
    Fix("copy_into_the_device", "keep both on one side",
        lambda t: t.x.clone().copy_(torch.ones(4)),
        lambda t: t.x.clone().copy_(torch.ones(4, device=t.x.device))),
    Fix("mask_index", "torch.where(mask, x, 0)",
        lambda t: t.x[t.mask].sum(), lambda t: torch.where(t.mask, t.x, 0).sum()),
    Fix("mask_index_static", "torch.nonzero_static(mask, size=...)",
        lambda t: t.x[t.mask], lambda t: t.x[torch.nonzero_static(t.mask, size=4).squeeze(1)]),
    Fix("host_index", "make the index on the device",
        lambda t: t.x[torch.tensor([0, 2])], lambda t: t.x[torch.arange(0, 4, 2, device=t.device)]),
    Fix("device_number_index", "x[i.reshape(1)]",
        lambda t: t.x[t.i], lambda t: t.x[t.i.reshape(1)]),
    Fix("device_slice_bound", "torch.arange(bound, device=x.device) < n",
        lambda t: t.x[: t.n].sum(),
        lambda t: torch.where(torch.arange(4, device=t.x.device) < t.n, t.x, 0).sum()),
    Fix("mask_assign", "torch.where(mask, value, x)",
        lambda t: _set(t.x, t.mask, t.y), lambda t: torch.where(t.mask, t.y, t.x)),
    Fix("mask_and_index_assign", "fold another index into the mask first",
        lambda t: _set(t.grid, (t.mask, t.cols), 1.0),
        lambda t: t.grid.masked_fill(
            t.mask[:, None] & (torch.arange(3, device=t.device) == t.row_cols[:, None]), 1.0)),
    Fix("host_index_assign", "make the index on the device",
        lambda t: _set(t.x, t.host_ind, t.y), lambda t: _set(t.x, t.ind, t.y)),
    Fix("device_number_assign", "x[i.reshape(1)] = value",
        lambda t: _set(t.x, t.i, 1.0), lambda t: _set(t.x, t.i.reshape(1), 1.0)),
    Fix("one_hot", "pass num_classes=", lambda t: F.one_hot(t.ind),
        lambda t: F.one_hot(t.ind, num_classes=4)),
    Fix("cross_entropy", "weight[target].sum()",
        lambda t: F.cross_entropy(t.logits, t.labels, weight=t.weight, label_smoothing=0.1),
        _weighted_smoothed),
    Fix("isin_elementwise", "(x[..., None] == test).any(-1)",
        lambda t: torch.isin(t.ind, t.many), lambda t: (t.ind[..., None] == t.many).any(-1)),
    Fix("isin_table", "scatter_(0, test, True)[x]", lambda t: torch.isin(t.ind, t.many),
        lambda t: torch.zeros(400, dtype=torch.bool, device=t.device).scatter_(0, t.many, True)[
            t.ind]),
    Fix("repeat_interleave", "pass output_size=",
        lambda t: torch.repeat_interleave(t.x, t.repeats),
        lambda t: torch.repeat_interleave(t.x, t.repeats, output_size=8)),
    Fix("nonzero", "torch.nonzero_static(x, size=...)",
        lambda t: t.x.nonzero(), lambda t: torch.nonzero_static(t.x, size=4)),
    Fix("where_one_argument", "three-argument torch.where",
        lambda t: t.x.sum() * torch.where(t.mask)[0].numel(),
        lambda t: torch.where(t.mask, t.x, 0).sum()),
    Fix("masked_select", "torch.where(mask, x, 0)",
        lambda t: t.x.masked_select(t.mask).sum(), lambda t: torch.where(t.mask, t.x, 0).sum()),
    Fix("masked_fill_device_value", "torch.where(mask, value, x)",
        lambda t: t.x.masked_fill(t.mask, t.y), lambda t: torch.where(t.mask, t.y, t.x)),
    Fix("unique", "scatter_(0, x, True)", lambda t: torch.unique(t.ind),
        lambda t: torch.zeros(4, dtype=torch.bool, device=t.device).scatter_(0, t.ind, True)),
    Fix("bincount", "scatter_add_(0, x, torch.ones_like(x))",
        lambda t: torch.bincount(t.ind), _counts),
    Fix("histc", "pass min= and max=",
        lambda t: torch.histc(t.x, 4), lambda t: torch.histc(t.x, 4, min=0, max=1)),
    Fix("equal", "torch.isclose(a, b).all()",
        lambda t: torch.equal(t.x, t.x.clone()), lambda t: torch.isclose(t.x, t.x.clone()).all()),
    Fix("allclose", "torch.isclose(a, b).all()",
        lambda t: torch.allclose(t.x, t.x.clone()),
        lambda t: torch.isclose(t.x, t.x.clone()).all()),
    Fix("linalg_inv", "torch.linalg.inv_ex",
        lambda t: torch.linalg.inv(t.sym), lambda t: torch.linalg.inv_ex(t.sym)),
    Fix("linalg_cholesky", "cholesky_ex",
        lambda t: torch.linalg.cholesky(t.sym), lambda t: torch.linalg.cholesky_ex(t.sym)),
    Fix("linalg_eigh", "no sync-free form", lambda t: torch.linalg.eigh(t.sym), None),
    Fix("ctc_loss", "pass input and target lengths as host tensors or lists",
        lambda t: F.ctc_loss(t.logits[:, None].log_softmax(-1), t.labels[None, :2] + 1,
                             t.repeats.new_full((1,), 6), t.repeats),
        lambda t: F.ctc_loss(t.logits[:, None].log_softmax(-1), t.labels[None, :2] + 1,
                             [6], [2])),
    Fix("backward_of_mask_index", "use torch.where(mask, x, 0)",
        _backward(lambda w: w[w > 0]), _backward(lambda w: torch.where(w > 0, w, 0))),
    Fix("backward_of_cumprod", "exp(cumsum(log(x)))",
        _positive_backward(lambda w: torch.cumprod(w, 0)),
        _positive_backward(lambda w: torch.exp(torch.cumsum(torch.log(w), 0)))),
    Fix("backward_of_prod", "exp(sum(log(x)))",
        _positive_backward(lambda w: torch.prod(w).reshape(1)),
        _positive_backward(lambda w: torch.exp(torch.log(w).sum()).reshape(1))),
    Fix("backward_of_masked_scatter", "torch.where(mask, source_expanded, x)",
        lambda t: _positive_backward(lambda w: w.masked_scatter(t.mask, t.source))(t),
        lambda t: _positive_backward(lambda w: torch.where(t.mask, t.source, w))(t)),
    Fix("grad_scaler", "no sync-free form with float16", _scaler, None),
    # Libraries' reads (rules.LIBRARY_READS), fixed with the library's own settings
    Fix("torchmetrics_defaults", ('average="micro"', "validate_args=False"),
        lambda t: t.metrics["accuracy"](t.logits.argmax(1), t.labels),
        lambda t: t.metrics["accuracy_fixed"](t.logits.argmax(1), t.labels)),
    Fix("torchmetrics_nan_check", 'nan_strategy="disable"',
        lambda t: t.metrics["mean"](t.x), lambda t: t.mean(t.x)),
    Fix("metric_collection_groups", "compute_groups=False",
        lambda t: t.metrics["collection"].update(t.logits, t.labels),
        lambda t: t.metrics["collection_fixed"].update(t.logits, t.labels)),
    Fix("distribution_checks", "validate_args=False",
        lambda t: _normal(t).log_prob(t.x),
        lambda t: _normal(t, validate_args=False).log_prob(t.x)),
    Fix("transformer_causal_mask", "is_causal=True",
        lambda t: t.encoder(t.sequence, mask=t.causal),
        lambda t: t.encoder(t.sequence, mask=t.causal, is_causal=True)),
]  # fmt: skip
