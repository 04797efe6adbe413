"""Device values brought to the host: later without a wait (``LateRead``), or now in one
copy for many (``numbers_in_one_copy``), never an ``.item()`` each.

Example::

    late = LateRead()
    late.put(torch.stack([loss, acc]))                 # at a logging step: nothing waits
    ...
    late.take(wait=False)                              # [loss, acc] once copied, else None
    numbers_in_one_copy({"loss": loss, "acc": acc})    # {"loss": 0.31, "acc": 0.9}: one copy
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from gpu_busy.cuda_runtime import runtime
from gpu_busy.event_pool import cuda_event


class LateRead:
    """Device values brought to the host without a wait: copied at one point, read later.

    ``put`` starts a ``non_blocking`` copy into pinned host memory (CUDA allocates the
    destination pinned for a ``non_blocking`` move to the CPU) and records an event after
    it; ``take`` returns the values once that event has completed, by then at no cost. One
    copy in flight: a ``put`` replaces the one not yet taken. Off CUDA the copy is plain.

    Example::

        late = LateRead()
        late.put(torch.stack([loss, flag]))   # at a logging step: queued, nothing waits
        ...
        late.take(wait=False)                 # [loss, flag] once copied, else None
        late.take()                           # waits if the copy is still running
    """

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._recorded = False

    @property
    def pending(self) -> bool:
        return self._host is not None

    def put(self, values: torch.Tensor) -> None:
        self._host = values.detach().to("cpu", non_blocking=True)
        cuda = runtime()
        self._recorded = cuda.takes_route(values.device)
        if self._recorded:
            if self._event is None:
                self._event = cuda_event()
            self._event.record(cuda.current_stream(values.device))

    def take(self, wait: bool = True) -> list | None:
        """The values of the last ``put`` (None if none is pending, or, with ``wait=False``,
        while its copy is still running)."""
        if self._host is None:
            return None
        if self._recorded and not self._event.query():
            if not wait:
                return None
            self._event.synchronize()  # a copy queued a window ago: the rare case
        host, self._host = self._host, None
        return host.tolist()


def numbers_in_one_copy(data: Any) -> Any:
    """``data`` with each tensor (one element each) replaced by its number, in one
    device-to-host copy per device: their bytes, concatenated, copied once and read back in
    their own dtypes (the numbers ``.item()`` gives). ``lightning_compat`` hands it to
    Lightning's loggers in place of an ``.item()`` per value.

    Example::

        numbers_in_one_copy({"loss": loss, "acc": acc, "epoch": 3})  # one copy, not two
    """
    found: list[Tensor] = []
    apply_to_collection(data, Tensor, found.append)
    for t in found:
        if t.numel() != 1:
            raise ValueError(
                f"a logged value must be one number, not a tensor of shape {tuple(t.shape)}: "
                "log a reduction of it (.mean(), .sum()) or one element"
            )
    numbers: dict[int, Any] = {id(t): t.item() for t in found if t.is_quantized}
    for device in {t.device for t in found if not t.is_quantized}:
        # by dtype, widest first: each dtype's bytes then start at a multiple of its size
        group = sorted(
            (t for t in found if t.device == device and not t.is_quantized),
            key=lambda t: (t.element_size(), str(t.dtype)),
            reverse=True,
        )
        raw = torch.cat([t.detach().reshape(1).view(torch.uint8) for t in group]).cpu()
        at = 0
        for dtype, same in itertools.groupby(group, key=lambda t: t.dtype):
            same = list(same)
            end = at + len(same) * same[0].element_size()
            numbers.update(zip(map(id, same), raw[at:end].view(dtype).tolist(), strict=True))
            at = end
    return apply_to_collection(data, Tensor, lambda t: numbers[id(t)])
