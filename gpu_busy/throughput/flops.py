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

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import (
    FlopCounterMode,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)


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
