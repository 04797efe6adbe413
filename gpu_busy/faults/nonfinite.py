"""The first NaN or Inf among a run of device values, recorded on the device: no host reads.

``StopOnNonFiniteLoss`` feeds it each training loss and reads it only where a read happens
anyway (logging steps, before validation, at an epoch's end).

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

    def __init__(self) -> None:
        self._seen: torch.Tensor | None = None  # updates so far, on the device
        self._first: torch.Tensor | None = None  # first bad index, -1 while none

    def update(self, value: torch.Tensor) -> None:
        value = value.detach()
        if self._seen is None or self._seen.device != value.device:
            self._seen = torch.zeros((), dtype=torch.long, device=value.device)
            self._first = torch.full((), -1, dtype=torch.long, device=value.device)
        bad = ~torch.isfinite(value).all()
        self._first = torch.where(bad & (self._first < 0), self._seen, self._first)
        self._seen += 1

    def first_tensor(self) -> torch.Tensor | None:
        return self._first

    def first(self) -> int | None:
        if self._first is None:
            return None
        index = int(self._first.item())
        return None if index < 0 else index
