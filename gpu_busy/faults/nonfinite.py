"""The first NaN or Inf among a run of device values, found on the device: no host reads.

``StopOnNonFiniteLoss`` feeds it each training loss and reads it only where a read happens
anyway (logging steps, before validation, at an epoch's end). An update holds the value
(a detached reference: no device work); every ``fold_every`` updates, and when asked, the
values held are checked on the device in one batch of ops.

Example::

    watch = FirstNonFinite()
    for loss in losses:
        watch.update(loss)
    watch.first()      # one read: the index of the first NaN/Inf update, or None
"""

from __future__ import annotations

import torch


class FirstNonFinite:
    """Device-side record of the first update whose value was not finite."""

    def __init__(self, fold_every: int = 64) -> None:
        self.fold_every = fold_every
        self._held: list[torch.Tensor] = []  # values not yet checked
        self._seen = 0  # values checked so far
        self._first: torch.Tensor | None = None  # first bad index on the device, -1 while none

    def update(self, value: torch.Tensor) -> None:
        self._held.append(value.detach())
        if len(self._held) >= self.fold_every:
            self._fold()

    def first_tensor(self) -> torch.Tensor | None:
        """The first bad index so far as a device tensor (-1: none); None before any update."""
        self._fold()
        return self._first

    def first(self) -> int | None:
        first = self.first_tensor()
        if first is None:
            return None
        index = int(first.item())
        return None if index < 0 else index

    def _fold(self) -> None:
        held, self._held = self._held, []
        if not held:
            return
        if all(v.dim() == 0 and v.device == held[0].device for v in held):
            finite = torch.stack(held).isfinite()
        else:
            device = held[-1].device
            finite = torch.stack([torch.isfinite(v).all().to(device) for v in held])
        bad = ~finite
        here = torch.where(bad.any(), bad.int().argmax() + self._seen, -1)
        if self._first is None or self._first.device != here.device:
            self._first = here
        else:
            self._first = torch.where(self._first >= 0, self._first, here)
        self._seen += len(held)
