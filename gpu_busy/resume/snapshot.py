"""A checkpoint's state copied into host memory the loop can go on without: what a
background write saves, exactly as it was at the save.

A checkpoint dict holds the live tensors themselves (``state_dict()`` shares the
parameters' and the optimizer's storage; a module kept in the hyperparameters is the live
module), so a thread that serialises it while training goes on writes a mix of steps.
``StateSnapshot.take`` copies it the way ``torch.save`` reaches it: it pickles the
checkpoint in memory with the serializer's own hook for storages (``persistent_id``), so
every storage is found wherever it sits (a dict, a dataclass, an ``nn.Module`` or an
optimizer pickled whole), and unpickles it with each storage replaced by a host buffer of
its own (kept and reused by the next save of the same layout). Everything else is copied
by the pickle round trip, so an object training changes later is not seen either.

On CUDA the device storages are copied on a side stream into pinned buffers: the stream
first waits for the compute stream's work so far (the state at the save), and the compute
stream then waits for the copies (an event, on the device), so the next optimizer step
cannot overwrite a tensor before it is copied and the host does not wait at all. No copy
is made on the device, and the writer, after ``ready`` (that event), reads host memory
only. CPU storages are copied at once.

Example::

    snapshot = StateSnapshot()
    state, ready = snapshot.take(checkpoint)     # the loop goes on after this
    ...                                          # in a writer thread:
    ready()                                      # the device copies have landed
    torch.save(state, buffer)
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any

import torch


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
        self._on_device = on_device or (lambda s: s.device.type == "cuda")
        self._buffers: list[torch.UntypedStorage] = []
        self._streams: dict[torch.device, Any] = {}

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
        reached: list[torch.UntypedStorage] = []
        index: dict[int, int] = {}  # by storage: views of one share it, as torch.save keeps

        class Reach(pickle.Pickler):
            def persistent_id(self, obj: Any) -> Any:
                if isinstance(obj, torch.storage.TypedStorage):
                    storage, dtype = obj._untyped_storage, obj.dtype
                elif isinstance(obj, torch.UntypedStorage):
                    storage, dtype = obj, None
                else:
                    return None
                if storage.device.type == "meta":  # no data: pickled as it is
                    return None
                key = storage._cdata
                if key not in index:
                    index[key] = len(reached)
                    reached.append(storage)
                return index[key], dtype

        structure = io.BytesIO()
        Reach(structure, protocol=pickle.HIGHEST_PROTOCOL).dump(checkpoint)
        buffers = []
        on_device: dict[torch.device, list[tuple[Any, Any]]] = {}
        for i, storage in enumerate(reached):
            device = self._on_device(storage)
            buffers.append(buffer := self._buffer(i, storage, pinned=device))
            if device:
                on_device.setdefault(storage.device, []).append((buffer, storage))
            else:
                buffer.copy_(storage)
        del self._buffers[len(reached) :]  # a smaller layout than last time: free the rest
        events = [self._copy_on_side_stream(d, pairs) for d, pairs in on_device.items()]

        class Rebuild(pickle.Unpickler):
            def persistent_load(self, pid: Any) -> Any:
                i, dtype = pid
                if dtype is None:
                    return buffers[i]
                return torch.storage.TypedStorage(
                    wrap_storage=buffers[i], dtype=dtype, _internal=True
                )

        structure.seek(0)
        state = Rebuild(structure).load()

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
                buffer.copy_(storage, non_blocking=True)  # pinned: no host wait
        done = cuda.Event()
        done.record(side)
        compute.wait_event(done)  # the next step's writes wait for the copies, on the GPU
        return done
