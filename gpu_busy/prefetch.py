"""Copy the next batches to the GPU on a side stream while the current step computes.

The copy of batch N+1 is enqueued on a side stream before step N's kernels; the compute
stream waits on the device for each batch's copy event when the batch is handed over.
Memory: ``depth + 1`` batches are on the device (``depth + 2`` for a loader without a
length, which Lightning's fetcher reads one ahead); count them in the batch size. Off
CUDA the same look-ahead runs with a synchronous move. Details: docs/ARCHITECTURE.md,
"Prefetching batches on a side stream".

Example::

    copier = StreamCopier(torch.device("cuda"))          # one side stream, reused
    for x, y in PrefetchIterator(loader, copier, depth=1):
        loss = model(x).cross_entropy(y)                 # x, y already on the GPU;
        ...                                              # the next batch is copying
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
import warnings
from abc import ABC
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils._pytree import tree_flatten, tree_unflatten

from gpu_busy.cuda_runtime import runtime
from gpu_busy.event_pool import EventPool, cuda_event
from gpu_busy.syncs.memory import NewTensors, held_tensors, plain_tensors
from gpu_busy.window_sums import WindowSums

PAGEABLE_WARNING = (
    "batches reach the prefetcher in pageable host memory, where a non_blocking copy "
    "blocks the host: create the DataLoader with pin_memory=True (it pins in a background "
    "thread). Until then the prefetcher pins each batch in its own thread."
)


@dataclass
class PrefetchStats(WindowSums):
    """Sums over the batches handed out in a window. ``means()`` gives per-copy figures.

    ``copy_ms`` is device time on the side stream (CUDA events) or host time of the
    synchronous move elsewhere. ``exposed_copy_ms`` is how long the compute stream had to
    wait for a copy to finish: CUDA only, so ``exposed_copies`` stays 0 on a CPU.
    """

    batches: int = 0
    copies: int = 0
    copy_ms: float = 0.0
    exposed_copies: int = 0
    exposed_copy_ms: float = 0.0
    pageable_batches: int = 0
    unmoved_batches: int = 0  # left to Lightning: an object's .to takes no non_blocking

    def means(self) -> dict[str, float | None]:
        """Per-copy time, exposed time and hidden share; None = n/a."""
        copy = self.copy_ms / self.copies if self.copies else None
        exposed = self.exposed_copy_ms / self.exposed_copies if self.exposed_copies else None
        hidden = None
        if self.exposed_copies and self.copy_ms > 0:
            hidden = 100.0 * max(0.0, 1.0 - self.exposed_copy_ms / self.copy_ms)
        return {
            "copy_ms": copy,
            "exposed_copy_ms": exposed,
            "hidden_copy_pct": hidden,
        }

    def counts(self) -> dict[str, int]:
        return {
            "batches": self.batches,
            "pageable_batches": self.pageable_batches,
            "unmoved_batches": self.unmoved_batches,
        }


@dataclass
class InFlightBatch:
    """A batch whose copy has been issued but not yet handed to the compute stream."""

    batch: Any = None
    ready: torch.cuda.Event | None = None  # recorded on the side stream after the copy
    copy_start: torch.cuda.Event | None = None  # timing; None if the pool ran dry
    pinning: Future | None = None  # the pinning thread's InFlightBatch, when it pins
    host_copy_ms: float | None = None  # non-CUDA: host time of the synchronous move
    pageable: bool = False
    unmoved: bool = False  # handed over as it came: Lightning moves it
    tensors: list = field(default_factory=list)  # the moved tensors, for record_stream


class _Leaves:
    """A batch's tensors, found in one walk, and the batch rebuilt around new ones.

    Plain lists, tuples and dicts of tensors and numbers (the usual batch) are walked by
    hand; namedtuples and tensor subclasses by torch's pytree; any other leaf (a dataclass,
    an object with its own ``.to``) by ``apply_to_collection``, as Lightning's transfer
    does. An object whose ``.to`` takes ``non_blocking`` (PyTorch Geometric's ``Data`` and
    ``Batch``) is one of ``objects``, moved by its own ``.to``; ``mover`` is the type of one
    whose ``.to`` does not, or None.
    """

    __slots__ = ("_rebuild", "mover", "objects", "tensors")

    def __init__(self, batch: Any) -> None:
        tensors: list[torch.Tensor] = []
        if plain_tensors(batch, tensors):
            # The usual batch, lists, tuples and dicts of tensors and numbers (Lightning
            # hands the prefetcher ``(batch, batch_idx, dataloader_idx)``): walked by hand,
            # at a tenth of pytree's flatten and unflatten (11 us a batch, bench.host).
            self.tensors, self.mover, self.objects = tensors, None, []
            self._rebuild = lambda moved, objects=(): _plain_rebuild(batch, iter(moved))  # none
            return
        leaves, spec = tree_flatten(batch)
        if all(isinstance(x, _SIMPLE) for x in leaves):
            slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
            self.tensors: list[torch.Tensor] = [leaves[i] for i in slots]
            self.mover: type | None = None
            self.objects: list[Any] = []

            def rebuild(tensors: list[torch.Tensor], objects: Any = ()) -> Any:
                out = list(leaves)
                for i, t in zip(slots, tensors, strict=True):
                    out[i] = t
                return tree_unflatten(out, spec)

        else:
            self.tensors, self.objects, movers = [], [], []

            def see(leaf: Any) -> Any:
                if isinstance(leaf, torch.Tensor):
                    self.tensors.append(leaf)
                elif _takes_non_blocking(type(leaf)):
                    self.objects.append(leaf)
                elif not movers:
                    movers.append(type(leaf))
                return leaf

            apply_to_collection(batch, _Movable, see)
            self.mover = movers[0] if movers else None

            def rebuild(tensors: list[torch.Tensor], objects: Any = ()) -> Any:
                ts, objs = iter(tensors), iter(objects)
                return apply_to_collection(
                    batch, _Movable, lambda x: next(ts if isinstance(x, torch.Tensor) else objs)
                )

        self._rebuild = rebuild

    def rebuild(self, tensors: list[torch.Tensor], objects: Any = ()) -> Any:
        """The batch with its tensors, and its objects that move themselves, replaced."""
        return self._rebuild(tensors, objects)


@functools.cache
def _takes_non_blocking(kind: type) -> bool:
    """Whether ``kind.to`` takes ``non_blocking`` (by name or as any keyword)."""
    try:
        params = inspect.signature(kind.to).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return any(p.name == "non_blocking" or p.kind is p.VAR_KEYWORD for p in params)


def _plain_rebuild(x: Any, moved: Iterator[torch.Tensor]) -> Any:
    kind = type(x)
    if kind is torch.Tensor:
        return next(moved)
    if kind is tuple:
        return tuple(_plain_rebuild(v, moved) for v in x)
    if kind is list:
        return [_plain_rebuild(v, moved) for v in x]
    if kind is dict:
        return {k: _plain_rebuild(v, moved) for k, v in x.items()}
    return x


class _Movable(ABC):  # noqa: B024 - a structural check, nothing to implement
    """What Lightning moves to the device: anything with a ``.to`` method (its
    ``_TransferableDataType`` rule), tensors included."""

    @classmethod
    def __subclasshook__(cls, subclass: type) -> bool:
        return callable(getattr(subclass, "to", None)) if cls is _Movable else NotImplemented


_SIMPLE = (torch.Tensor, int, float, bool, str, bytes, type(None))


class StreamCopier:
    """Copies host batches to ``device`` on one side stream and hands them over safely.

    ``start(batch)`` issues the copy and returns at once; ``finish(in_flight, stats)``
    makes the current stream wait for that copy and returns the device batch. Copy
    timings are read back later with ``query()`` (``poll``), never by blocking.

    ``pin_memory``: pin pageable batches in a background thread before copying (True), or
    copy them as they are (False: the copy then blocks the host). Either way a warning
    says once how to pin in the DataLoader instead.
    """

    def __init__(
        self, device: torch.device | str, *, pin_memory: bool = True, timing_events: int = 96
    ) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._host = device.type == "cpu"  # moves give views there (NewTensors)
        self.is_cuda = runtime().takes_route(device)
        self.pin_memory = pin_memory
        self._stream: torch.cuda.Stream | None = None
        self._consumer: Any = None  # the current stream, asked once per poll() (a window)
        self._events = EventPool(timing_events) if self.is_cuda else None
        self._pending: deque[tuple[Any, ...]] = deque()  # (start, ready, consumer, stats)
        # Timing events of copies issued but not yet handed over: an iterator abandoned
        # mid-epoch (early stopping, an exception) never hands them over; close() frees them.
        self._issued: dict[int, tuple[Any, Any]] = {}
        self._pin_pool: ThreadPoolExecutor | None = None
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    @property
    def stream(self) -> torch.cuda.Stream:
        """The side stream, created once (a new stream per epoch grows reserved memory)."""
        if self._stream is None:
            self._stream = runtime().new_stream(self.device)
        return self._stream

    def start(self, batch: Any) -> InFlightBatch:
        leaves = _Leaves(batch)  # the one walk of the batch
        if leaves.mover is not None:
            name = leaves.mover.__name__
            self._warn_once(
                "unmoved",
                f"StreamPrefetcher leaves batches holding {name} to Lightning: {name}.to() "
                "takes no non_blocking, so it cannot copy on a side stream without blocking. "
                "Those batches are copied on the compute stream, without overlap; give "
                f"{name}.to a non_blocking argument passed to each tensor's .to() (as "
                "PyTorch Geometric's Data.to does), or return tensors, dicts or dataclasses "
                "of tensors from the DataLoader.",
            )
            return InFlightBatch(batch, unmoved=True)
        if not self.is_cuda:
            t0 = time.perf_counter()
            moved = leaves.rebuild(
                [self._moved(t, non_blocking=False) for t in leaves.tensors],
                # as on CUDA: the sync detector's simulation sees the copies a GPU would make
                [self._moved_object(o) for o in leaves.objects],
            )
            return InFlightBatch(moved, host_copy_ms=1e3 * (time.perf_counter() - t0))
        if _pageable(leaves):
            self._warn_once("pageable", PAGEABLE_WARNING)
            if self.pin_memory:
                if self._pin_pool is None:
                    self._pin_pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch-pin")
                return InFlightBatch(pinning=self._pin_pool.submit(self._pin_and_copy, leaves))
            return self._copy(leaves, leaves.tensors, pageable=True)
        return self._copy(leaves, leaves.tensors)

    def finish(self, in_flight: InFlightBatch, stats: PrefetchStats) -> Any:
        """Make the current stream wait for this batch's copy; return the device batch."""
        if in_flight.pinning is not None:
            in_flight = in_flight.pinning.result()
        if in_flight.pageable:
            stats.pageable_batches += 1
        if in_flight.unmoved:
            stats.unmoved_batches += 1
            return in_flight.batch
        if not self.is_cuda:
            stats.copies += 1
            stats.copy_ms += in_flight.host_copy_ms or 0.0
            return in_flight.batch
        cuda = runtime()
        if self._consumer is None:
            self._consumer = cuda.current_stream(self.device)
        consumer = self._consumer
        reached = None
        with self._lock:
            self._issued.pop(id(in_flight.copy_start), None)
        if in_flight.copy_start is not None:
            # When the compute stream got here: if the copy ends later, it waited.
            reached = self._events.acquire()
            if reached is None:
                self._events.release(in_flight.copy_start, in_flight.ready)
            else:
                reached.record(consumer)
        consumer.wait_event(in_flight.ready)
        for t in in_flight.tensors:
            if t.device == self.device:
                cuda.record_stream(t, consumer)
        if reached is not None:
            self._pending.append((in_flight.copy_start, in_flight.ready, reached, stats))
        return in_flight.batch

    def poll(self, block: bool = False) -> None:
        """Credit finished copy timings to their stats, oldest first: once per logging
        window, not per batch. The current stream is asked again at the next batch.

        ``block=True`` waits for the outstanding ones: for the end of a run only.
        """
        self._consumer = None
        while self._pending:
            start, end, reached, stats = self._pending[0]
            if block:
                end.synchronize()
                reached.synchronize()
            elif not (end.query() and reached.query()):
                return
            self._pending.popleft()
            stats.copies += 1
            stats.copy_ms += start.elapsed_time(end)
            stats.exposed_copies += 1
            stats.exposed_copy_ms += max(0.0, reached.elapsed_time(end))
            self._events.release(start, end, reached)

    def close(self) -> None:
        """Stop the pinning thread and give the timing events of copies not yet read back,
        or never handed over, to the pool (a later fit would otherwise find it drained and
        time nothing)."""
        if self._pin_pool is not None:
            self._pin_pool.shutdown(wait=True)
            self._pin_pool = None
        while self._pending:
            start, end, reached, _ = self._pending.popleft()
            self._events.release(start, end, reached)
        with self._lock:
            issued, self._issued = list(self._issued.values()), {}
        for start, ready in issued:
            self._events.release(start, ready)

    # -- internals ---------------------------------------------------------------

    def _copy(
        self,
        leaves: _Leaves,
        tensors: list[torch.Tensor],
        pageable: bool = False,
        objects: list[Any] | None = None,
    ) -> InFlightBatch:
        start = self._events.acquire()
        ready = self._events.acquire() if start is not None else None
        if start is not None and ready is None:
            self._events.release(start)
            start = None
        if ready is None:
            ready = cuda_event()  # still needed to order the streams
        with runtime().on_stream(self.stream):
            if start is not None:
                start.record(self.stream)
            moved = [self._moved(t, non_blocking=True) for t in tensors]
            # objects that move themselves: their .to, told non_blocking, copies each field
            objects = [self._moved_object(o) for o in (objects or leaves.objects)]
            ready.record(self.stream)
        if start is not None:
            with self._lock:
                self._issued[id(start)] = (start, ready)
        inner = [t for o in objects for t in held_tensors(o)]  # for record_stream at the hand-over
        return InFlightBatch(
            leaves.rebuild(moved, objects),
            ready=ready,
            copy_start=start,
            pageable=pageable,
            tensors=[*moved, *inner],
        )

    def _moved(self, t: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        if t.device != self.device:
            return t.to(self.device, non_blocking=non_blocking)
        return t.view_as(t) if self._host else t  # on the host, a new tensor: NewTensors

    def _moved_object(self, obj: Any) -> Any:
        """An object's own ``.to``, told ``non_blocking``: it copies each field."""
        with NewTensors() if self._host else contextlib.nullcontext():
            return obj.to(self.device, non_blocking=True)

    def _pin_and_copy(self, leaves: _Leaves) -> InFlightBatch:
        with runtime().on_device(self.device):
            pinned = [
                t.pin_memory() if t.device.type == "cpu" and not runtime().is_pinned(t) else t
                for t in leaves.tensors
            ]
            objects = [o.pin_memory() if hasattr(o, "pin_memory") else o for o in leaves.objects]
            return self._copy(leaves, pinned, pageable=True, objects=objects)

    def _warn_once(self, kind: str, message: str) -> None:
        with self._lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        warnings.warn(message, stacklevel=3)


def _pageable(leaves: _Leaves) -> bool:
    """Whether a batch holds host memory a copy would have to pin first. An object counts as
    pinned where any host tensor it holds is: its own ``pin_memory()`` may leave bookkeeping
    pageable (PyTorch Geometric's ``Batch`` leaves its slice dicts, seen on a GPU machine)."""
    pinned = runtime().is_pinned
    if any(t.device.type == "cpu" and not pinned(t) for t in leaves.tensors):
        return True
    for obj in leaves.objects:
        host = [t for t in held_tensors(obj) if t.device.type == "cpu"]
        if host and not any(pinned(t) for t in host):
            return True
    return False


class PrefetchIterator(Iterator):
    """Yields the items of ``source`` on the copier's device, ``depth`` items ahead.

    The copy of item N+1 is issued inside the call that returns item N, i.e. before the
    caller enqueues the work that uses item N. ``limit`` caps how many items are read
    from ``source`` (so a consumer that will stop after k items never causes item k+1 to
    be read). Each batch handed out, and its copy's timing, goes into ``stats``.

    ``held``: items the consumer itself reads ahead of its use (Lightning's fetcher, for a
    loader without a length, holds one). Those count toward ``depth``, so the source is
    read no further ahead than ``depth`` in all: an item's copy is issued when it is read,
    and the wait for it is queued ``held`` calls later (or at the end), when the consumer
    takes it out of its hold.

    Example::

        batches = PrefetchIterator(loader, copier, depth=1, held=1)  # under a one-ahead reader
    """

    def __init__(
        self,
        source: Iterable,
        copier: StreamCopier,
        *,
        depth: int = 1,
        limit: int | None = None,
        stats: PrefetchStats | None = None,
        held: int = 0,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self._source = iter(source)
        self.copier = copier
        self.depth = depth
        self.held = held
        self.limit = limit
        self.stats = stats if stats is not None else PrefetchStats()
        self.reads = 0
        self._queue: deque[InFlightBatch] = deque()
        self._in_hold: deque[InFlightBatch] = deque()  # handed out, not yet waited for
        self._exhausted = False

    def __next__(self) -> Any:
        if not self._queue:
            self._read()  # the first item, or the source could not keep ahead
        if not self._queue:
            while self._in_hold:  # the consumer hands these on without asking again
                self._finish(self._in_hold.popleft())
            raise StopIteration
        current = self._queue.popleft()
        while len(self._queue) < self.depth - self.held and self._read():
            pass
        if not self.held:
            return self._finish(current)
        if len(self._in_hold) == self.held:
            self._finish(self._in_hold.popleft())
        if current.pinning is not None:  # the consumer holds the batch itself
            current = current.pinning.result()
        self._in_hold.append(current)
        return current.batch

    def _finish(self, in_flight: InFlightBatch) -> Any:
        self.stats.batches += 1
        return self.copier.finish(in_flight, self.stats)

    def _read(self) -> bool:
        if self._exhausted or (self.limit is not None and self.reads >= self.limit):
            return False
        try:
            item = next(self._source)
        except StopIteration:
            self._exhausted = True
            return False
        self.reads += 1
        self._queue.append(self.copier.start(item))
        return True
