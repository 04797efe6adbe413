"""FLOPs of one real training batch, counted by PyTorch's own counter.

``FlopCount`` runs ``FlopCounterMode`` inside given calls (the step's forward, then its
backward), one mode per call so the mode stack stays ordered with the sync detector's.
Elementwise ops count 0, as MFU's convention has it; a recomputed (checkpointed) forward
counts, since the hardware ran it. ``CPU_ATTENTION`` adds the CPU's fused attention, which
the counter lacks (docs/ARCHITECTURE.md, "CUDA assumptions").

Example::

    count = FlopCount()
    loss = count.around(model.training_step)(batch, 0)
    count.around(loss.backward)()
    count.flops        # forward + backward FLOPs of this batch; None if nothing was counted
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import (
    FlopCounterMode,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from gpu_busy.syncs.memory import held_tensors


def _cpu_attention(query, key, value, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_attention_backward(
    grad_out, query, key, value, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


_aten = torch.ops.aten
CPU_ATTENTION = {
    getattr(_aten, name): formula
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_attention),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_attention_backward),
    )
    if hasattr(_aten, name)
}


class _GlobalOnly:
    """``FlopCounterMode``'s module tracker, without its hooks: only the total is read. The
    tracker hooks the inputs of every module call, and raises on a view that requires grad
    but has no ``grad_fn`` (a custom autograd Function running modules under ``no_grad``, as
    openai's diffusion UNets checkpoint their blocks: ``torch/autograd/graph.py``,
    ``_get_grad_fn_or_grad_acc``), which would end the user's fit."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _GlobalOnly:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _Counter(FlopCounterMode):
    """The total only, and a formula that fails is remembered, not raised into the step."""

    def __init__(self) -> None:
        super().__init__(display=False, custom_mapping=CPU_ATTENTION)
        self.mod_tracker = _GlobalOnly()  # what FlopCounterMode.__init__ set: its only use
        self.error: Exception | None = None

    def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
        try:
            return super()._count_flops(func_packet, out, args, kwargs)
        except Exception as err:  # the op ran; only its count is lost
            self.error = self.error or err
            return out


class FlopCount:
    """FLOPs summed over every call made through ``around``; ``error`` says why there is no
    count where counting failed (the calls themselves run as without it)."""

    def __init__(self) -> None:
        self.total = 0
        self.calls = 0
        self.error: str | None = None
        self._inside = False

    def around(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._inside:  # a backward inside a counted step (manual optimisation)
                return fn(*args, **kwargs)
            self._inside = True
            try:
                with _Counter() as counter:
                    out = fn(*args, **kwargs)
            finally:
                self._inside = False
            self.total += counter.get_total_flops()
            self.calls += 1
            if counter.error is not None and self.error is None:
                err = counter.error
                self.error = f"a FLOP formula raised {type(err).__name__}: {err}"
            return out

        return counted

    @property
    def flops(self) -> int | None:
        """None where no op with a formula ran (kernels the dispatcher never saw, such as a
        custom extension's, count nothing) or a formula failed (``error``)."""
        return None if self.error else (self.total or None)


@dataclass(frozen=True)
class WhatTrains:
    """What one batch's FLOPs hang on: which parameters require grad, which modules are in
    training mode, and the shapes of the batch's tensors past their first dimension (FLOPs
    are reckoned per sample, so a short last batch changes nothing). Taking one walks the
    parameters, the modules and the batch: cheap enough once per logging window.

    Example::

        before = WhatTrains.of(model, batch)
        model.backbone.requires_grad_(True)
        WhatTrains.of(model, batch).changes_from(before)
        # "parameters that require grad: 2 -> 4 of 4"
    """

    grads: tuple[bool, ...]
    training: tuple[bool, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, module: torch.nn.Module, batch: Any) -> WhatTrains:
        return cls(
            tuple(p.requires_grad for p in module.parameters()),
            tuple(m.training for m in module.modules()),
            tuple(tuple(t.shape[1:]) for t in held_tensors(batch)),
        )

    def changes_from(self, before: WhatTrains) -> str:
        """What changed since ``before``, in words; "" where nothing did."""
        changed = []
        for name, ours, theirs in (
            ("parameters that require grad", self.grads, before.grads),
            ("modules in training mode", self.training, before.training),
        ):
            if ours != theirs:
                changed.append(f"{name}: {sum(theirs)} -> {sum(ours)} of {len(ours)}")
        if self.shapes != before.shapes:
            changed.append("the batch's shapes (past the batch dimension)")
        return "; ".join(changed)


@dataclass(frozen=True)
class FlopSegment:
    """One count, covering its step and the steps up to the next segment's."""

    step: int  # where it was counted (or a known count reused, or counting stopped)
    per_batch: float | None
    samples: int | None  # the counted batch's; None where it had no size
    why: str  # "the fit's first step", or what changed
    error: str | None = None  # why the counter gave no figure, where it raised


class FlopCounts:
    """A fit's FLOPs per batch, counted again where what trains changes (``WhatTrains``):
    each segment covers the steps from its own to the next one's. A state met before
    reuses its count; after ``limit`` counts, a new state's steps are unknown (n/a, not a
    stale figure).

    Example::

        counts = FlopCounts()
        counts.counted(0, 3.1e9, 32, WhatTrains.of(model, batch), "the fit's first step")
        why = counts.check(WhatTrains.of(model, batch), next_step=51)  # at a logging step
        if why:
            ...  # count step 51, then counts.counted(51, ..., why)
        counts.of_step(60, samples=32)  # FLOPs of step 60
    """

    def __init__(self, limit: int = 8) -> None:
        self.limit = limit
        self.segments: list[FlopSegment] = []
        self.counted_steps: set[int] = set()  # run under the counter: not timed
        self._known: dict[WhatTrains, FlopSegment] = {}
        self._current: WhatTrains | None = None

    def counted(self, step: int, per_batch: float | None, samples: int | None,
                trains: WhatTrains | None, why: str, error: str | None = None) -> None:  # fmt: skip
        segment = FlopSegment(step, per_batch, samples, why, error)
        self.segments.append(segment)
        self.counted_steps.add(step)
        if trains is not None:
            self._known[trains] = segment
        self._current = trains

    def check(self, trains: WhatTrains, next_step: int) -> str | None:
        """At a logging step: what changed since the count in use, when the next step must
        be counted; None when nothing changed, or a known count now covers the steps."""
        if self._current is None or trains == self._current:
            return None
        why = trains.changes_from(self._current)
        self._current = trains
        known = self._known.get(trains)
        if known is not None:
            self.segments.append(FlopSegment(
                next_step, known.per_batch, known.samples, f"{why}, as counted at step {known.step}"
            ))  # fmt: skip
            return None
        if len(self._known) >= self.limit:
            self.segments.append(FlopSegment(
                next_step, None, None, f"{why}; not counted: {self.limit} counts made already"
            ))  # fmt: skip
            return None
        return why

    def of_step(self, step: int, samples: int | None) -> float | None:
        """The FLOPs of one step, by the segment that covers it (scaled to its samples)."""
        index = bisect.bisect_right([s.step for s in self.segments], step) - 1
        if index < 0:
            return None
        segment = self.segments[index]
        if segment.per_batch is None:
            return None
        if segment.samples and samples:
            return segment.per_batch * samples / segment.samples
        return segment.per_batch

    def covered(self, last_step: int) -> list[dict[str, Any]]:
        """Each segment with the steps it covers (``first``, ``last``), for the report."""
        ends = [s.step - 1 for s in self.segments[1:]] + [last_step]
        keys = ("first", "last", "flops_per_batch", "samples", "why")
        return [
            dict(zip(keys, (s.step, end, s.per_batch, s.samples, s.why), strict=True))
            for s, end in zip(self.segments, ends, strict=True)
        ]
