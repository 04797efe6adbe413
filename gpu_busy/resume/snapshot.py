"""A checkpoint's state copied into host memory the loop can go on without: what a
background write saves, exactly as it was at the save.

A checkpoint dict holds the live tensors themselves (``state_dict()`` shares the
parameters' and the optimizer's storage), so a thread that serialises it while training
goes on writes a mix of steps. ``StateSnapshot.take`` copies every tensor into a host
buffer of its own (kept and reused by the next save of the same layout) and deep-copies
the other leaves the collection holds by reference (a NumPy array, a set, an object).

On CUDA the device tensors are copied on a side stream into pinned buffers: the stream
first waits for the compute stream's work so far (the state at the save), and the compute
stream then waits for the copies (an event, on the device), so the next optimizer step
cannot overwrite a tensor before it is copied and the host does not wait at all. The
writer waits for ``ready`` (that event) before it reads the buffers. CPU tensors are
copied at once.

Example::

    snapshot = StateSnapshot()
    state, ready = snapshot.take(checkpoint)     # the loop goes on after this
    ...                                          # in a writer thread:
    ready()                                      # the device copies have landed
    torch.save(state, buffer)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

# Leaves the collection walk leaves as they are and that nobody mutates in place.
_IMMUTABLE = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device)


class StateSnapshot:
    """Host buffers for a checkpoint's tensors, reused while its layout stays the same.

    Args:
        cuda: where streams and events come from (``torch.cuda``); tests give a stand-in.
        on_device: which tensors take the side-stream route (by default CUDA tensors).
    """

    def __init__(
        self, cuda: Any = torch.cuda, on_device: Callable[[torch.Tensor], bool] | None = None
    ) -> None:
        self._cuda = cuda
        self._on_device = on_device or (lambda t: t.device.type == "cuda")
        self._buffers: list[torch.Tensor] = []
        self._streams: dict[torch.device, Any] = {}

    @property
    def bytes(self) -> int:
        """Host memory the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    @property
    def pinned(self) -> bool:
        return self._cuda.is_available() and any(b.is_pinned() for b in self._buffers)

    def take(self, checkpoint: Any) -> tuple[Any, Callable[[], None]]:
        """The checkpoint with every tensor in a host buffer and every mutable leaf copied;
        and ``ready``, which returns once the device copies have landed (at once on a CPU).
        Call ``take`` again only after the previous snapshot was written."""
        count = 0
        on_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        seen: dict[tuple, torch.Tensor] = {}  # one buffer per view, as torch.save keeps one

        def walk(x: Any) -> Any:
            nonlocal count
            if isinstance(x, torch.Tensor):
                if x.layout != torch.strided:  # sparse and the like: a plain copy, at once
                    return x.detach().to("cpu", copy=True)
                view = (x.device, x.data_ptr(), x.dtype, tuple(x.shape), x.stride())
                if view in seen:  # tied weights: the same memory under two names
                    return seen[view]
                device = self._on_device(x)
                buffer = seen[view] = self._buffer(count, x, pinned=device)
                count += 1
                if device:
                    on_device.setdefault(x.device, []).append((buffer, x))
                else:
                    buffer.copy_(x.detach())
                return buffer
            if isinstance(x, _IMMUTABLE):
                return x
            if isinstance(x, dict):
                out = copy.copy(x)  # its type and attributes (a state_dict's _metadata)
                for key, value in x.items():
                    out[key] = walk(value)
                return out
            if isinstance(x, list | tuple):
                items = [walk(v) for v in x]
                if isinstance(x, list):
                    return items
                return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
            return copy.deepcopy(x)  # an array, a set, an object: training could change it

        state = walk(checkpoint)
        del self._buffers[count:]  # a smaller layout than last time: free the rest
        events = [self._copy_on_side_stream(d, pairs) for d, pairs in on_device.items()]

        def ready() -> None:
            for event in events:
                event.synchronize()

        return state, ready

    def _buffer(self, index: int, t: torch.Tensor, pinned: bool) -> torch.Tensor:
        pinned = pinned and self._cuda.is_available()
        if index < len(self._buffers):
            b = self._buffers[index]
            if b.shape == t.shape and b.dtype == t.dtype and (not pinned or b.is_pinned()):
                return b
        b = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned)
        if index < len(self._buffers):
            self._buffers[index] = b
        else:
            self._buffers.append(b)
        return b

    def _copy_on_side_stream(
        self, device: torch.device, pairs: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> Any:
        cuda = self._cuda
        compute = cuda.current_stream(device)
        side = self._streams.get(device) or self._streams.setdefault(device, cuda.Stream(device))
        side.wait_stream(compute)  # the state as the compute stream leaves it at the save
        with cuda.stream(side):
            for buffer, t in pairs:
                buffer.copy_(t.detach(), non_blocking=True)  # pinned: no host wait
        done = cuda.Event()
        done.record(side)
        compute.wait_event(done)  # the next step's writes wait for the copies, on the GPU
        return done
