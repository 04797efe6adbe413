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


class FlopCount:
    """FLOPs summed over every call made through ``around``."""

    def __init__(self) -> None:
        self.total = 0
        self.calls = 0
        self._inside = False

    def around(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._inside:  # a backward inside a counted step (manual optimisation)
                return fn(*args, **kwargs)
            self._inside = True
            try:
                with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
                    out = fn(*args, **kwargs)
            finally:
                self._inside = False
            self.total += counter.get_total_flops()
            self.calls += 1
            return out

        return counted

    @property
    def flops(self) -> int | None:
        """None where no op with a formula ran (kernels the dispatcher never saw, such as a
        custom extension's, count nothing)."""
        return self.total or None
