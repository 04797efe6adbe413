"""A checkpoint's state copied into host memory the loop can go on without: what a
background write saves, exactly as it was at the save.

Storages are found as ``torch.save`` finds them (its ``persistent_id`` hook) and copied
into host buffers kept for the next save of the same layout; on CUDA the copies run on a
side stream into pinned memory, ordered by events, and the host never waits. Details
and sources: docs/ARCHITECTURE.md, "Saving and finding checkpoints".

Example::

    snapshot = StateSnapshot()
    state, ready = snapshot.take(checkpoint)     # the loop goes on after this
    ...                                          # in a writer thread:
    ready()                                      # the device copies have landed
    torch.save(state, buffer)
"""

from __future__ import annotations

import copy
import io
import pickle
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

# Leaves the walk keeps as they are: nobody changes them in place.
_IMMUTABLE = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device)


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A storage's bytes as a tensor, on its device."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _plain(t: torch.Tensor) -> bool:
    """A dense tensor whose bytes and view are all pickling would keep of it."""
    return (
        t.layout == torch.strided
        and t.device.type != "meta"
        and not (t.is_quantized or t.is_conj() or t.is_neg() or t.__dict__)
    )


def _on_cuda(storage: torch.UntypedStorage) -> bool:
    return storage.device.type == "cuda"


class StateSnapshot:
    """Host buffers for a checkpoint's tensors, reused while its layout stays the same.

    Args:
        cuda: where streams and events come from (``torch.cuda``); tests give a stand-in.
        on_device: which storages take the side-stream route (by default CUDA's).
    """

    def __init__(
        self, cuda: Any = torch.cuda, on_device: Callable[[torch.Tensor], bool] | None = None
    ) -> None:
        self._cuda = cuda
        self._on_device = on_device or _on_cuda
        self._buffers: list[torch.UntypedStorage] = []
        self._streams: dict[torch.device, Any] = {}

    def __getstate__(self) -> dict:
        # A plugin is pickled with the Trainer under ddp_spawn, before any save: the
        # buffers and streams are per process; a module pickles by its name.
        state = {**self.__dict__, "_buffers": [], "_streams": {}}
        if state["_cuda"] is torch.cuda:
            state["_cuda"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._cuda is None:
            self._cuda = torch.cuda

    @property
    def bytes(self) -> int:
        """Host memory the buffers hold."""
        return sum(b.nbytes() for b in self._buffers)

    @property
    def pinned(self) -> bool:
        return self._cuda.is_available() and any(b.is_pinned() for b in self._buffers)

    def take(self, checkpoint: Any) -> tuple[Any, Callable[[], None]]:
        """The checkpoint with every storage in a host buffer and every other object copied;
        and ``ready``, which returns once the device copies have landed (at once on a CPU).
        Call ``take`` again only after the previous snapshot was written. Raises what
        pickling raises for an object ``torch.save`` could not save either."""
        layout = _Layout(self)
        state = layout.walk(checkpoint)
        del self._buffers[len(layout.buffers) :]  # a smaller layout than last time: free the rest
        events = [self._copy_on_side_stream(d, pairs) for d, pairs in layout.on_device.items()]

        def ready() -> None:
            for event in events:
                event.synchronize()

        return state, ready

    def _buffer(
        self, index: int, storage: torch.UntypedStorage, pinned: bool
    ) -> torch.UntypedStorage:
        pinned = pinned and self._cuda.is_available()
        size = storage.nbytes()
        if index < len(self._buffers):
            b = self._buffers[index]
            if b.nbytes() == size and (not pinned or b.is_pinned()):
                return b
        b = torch.empty(size, dtype=torch.uint8, pin_memory=pinned).untyped_storage()
        if index < len(self._buffers):
            self._buffers[index] = b
        else:
            self._buffers.append(b)
        return b

    def _copy_on_side_stream(self, device: torch.device, pairs: list[tuple[Any, Any]]) -> Any:
        cuda = self._cuda
        compute = cuda.current_stream(device)
        side = self._streams.get(device) or self._streams.setdefault(device, cuda.Stream(device))
        side.wait_stream(compute)  # the state as the compute stream leaves it at the save
        with cuda.stream(side):
            for buffer, storage in pairs:
                # a tensor copy: non_blocking into pinned memory is a cudaMemcpyAsync
                _bytes(buffer).copy_(_bytes(storage), non_blocking=True)
        done = cuda.Event()
        done.record(side)
        compute.wait_event(done)  # the next step's writes wait for the copies, on the GPU
        return done


class _Layout:
    """One ``take``: the buffers its storages went to, by storage (views of one share it,
    as torch.save keeps), and the device copies still to start."""

    def __init__(self, snapshot: StateSnapshot) -> None:
        self.snapshot = snapshot
        self.buffers: list[torch.UntypedStorage] = []
        self.index: dict[int, int] = {}
        self.on_device: dict[torch.device, list[tuple[Any, Any]]] = {}

    def slot(self, storage: torch.UntypedStorage) -> int:
        """The storage's buffer, its copy started (the device's on the side stream)."""
        key = storage._cdata
        if key not in self.index:
            self.index[key] = i = len(self.buffers)
            device = self.snapshot._on_device(storage)
            self.buffers.append(buffer := self.snapshot._buffer(i, storage, pinned=device))
            if device:
                self.on_device.setdefault(storage.device, []).append((buffer, storage))
            else:
                _bytes(buffer).copy_(_bytes(storage))
        return self.index[key]

    def walk(self, x: Any) -> Any:
        # The containers a checkpoint is built of, and its plain tensors, walked here:
        # the same storages and buffers as pickling, at a sixth of its host time
        # (ResNet-50 with Adam, 803 tensors). Anything else goes through pickling.
        if type(x) is torch.Tensor and _plain(x):
            buffer = self.buffers[self.slot(x.untyped_storage())]
            return torch.empty(0, dtype=x.dtype).set_(
                buffer, x.storage_offset(), x.size(), x.stride()
            )
        if isinstance(x, _IMMUTABLE):
            return x
        if type(x) in (dict, OrderedDict):
            out = copy.copy(x)  # its attributes too (a state_dict's _metadata)
            for key, value in x.items():
                out[key] = self.walk(value)
            return out
        if type(x) in (list, tuple):
            return type(x)(self.walk(v) for v in x)
        return self.copied(x)  # an object, a module, an array, a set: training could change it

    def copied(self, obj: Any) -> Any:
        """``obj`` as torch.save reaches it: every storage it holds, however deep."""
        data = io.BytesIO()
        _Reach(self, data, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        data.seek(0)
        return _Rebuild(self, data).load()


class _Reach(pickle.Pickler):
    def __init__(self, layout: _Layout, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layout = layout

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            storage, dtype = obj._untyped_storage, obj.dtype
        elif isinstance(obj, torch.UntypedStorage):
            storage, dtype = obj, None
        else:
            return None
        if storage.device.type == "meta":  # no data: pickled as it is
            return None
        return self.layout.slot(storage), dtype


class _Rebuild(pickle.Unpickler):
    def __init__(self, layout: _Layout, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layout = layout

    def persistent_load(self, pid: Any) -> Any:
        i, dtype = pid
        if dtype is None:
            return self.layout.buffers[i]
        return torch.storage.TypedStorage(
            wrap_storage=self.layout.buffers[i], dtype=dtype, _internal=True
        )
