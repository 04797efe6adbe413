"""A bounded pool of CUDA timing events, read back without blocking.

Creating an event per measurement grows without bound when the host runs ahead of the
GPU; reading one with ``synchronize()`` or ``elapsed_time()`` before it has completed
stalls the host (the second raises). The pool hands out at most ``capacity`` events;
callers keep them until ``query()`` says they completed, then give them back.

Example::

    pool = EventPool(capacity=64)
    start, end = pool.acquire(), pool.acquire()   # None when the pool is exhausted
    start.record(stream); ...; end.record(stream)
    if end.query():                                # never blocks
        ms = start.elapsed_time(end)
        pool.release(start, end)
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import torch

from gpu_busy.cuda_runtime import runtime

_forked_children_safe = False


def cuda_event(enable_timing: bool = False) -> torch.cuda.Event:
    """``torch.cuda.Event``, after making this process's forked children leave it alone.

    A forked child (a DataLoader worker) inherits every object not yet collected here. If
    a recorded event sits in a reference cycle (a finished Trainer and its callbacks),
    the child's first collection frees it, and its destructor calls CUDA, which a forked
    child cannot: c10::cuda::ExchangeDevice raises inside the destructor and the worker
    dies in terminate() ("CUDA error: initialization error"; seen on a GPU machine). So
    the first event made registers ``gc.freeze`` to run in each forked child: what it
    inherited stays out of its collections (the child never uses it, and its pages stay
    shared); what it makes itself is collected as usual.
    """
    global _forked_children_safe
    if not _forked_children_safe:
        os.register_at_fork(after_in_child=gc.freeze)
        _forked_children_safe = True
    return runtime().event(timing=enable_timing)


class EventPool:
    """At most ``capacity`` timing events in use at once; ``acquire`` returns None past it."""

    def __init__(self, capacity: int = 64) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._free: list[torch.cuda.Event] = []
        self._created = 0
        # The prefetcher's pinning thread records events too.
        self._lock = threading.Lock()

    def acquire(self) -> torch.cuda.Event | None:
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._created >= self.capacity:
                return None
            self._created += 1
        return cuda_event(enable_timing=True)

    def release(self, *events: torch.cuda.Event | None) -> None:
        with self._lock:
            self._free.extend(e for e in events if e is not None)


class HostEvent:
    """A host-clock stand-in for ``torch.cuda.Event``: complete as soon as recorded."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0.0

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: HostEvent) -> float:
        return 1e3 * (end.t - self.t)


class HostEventPool:
    """Host-clock events for a device without a queue of its own (the CPU)."""

    def acquire(self) -> HostEvent:
        return HostEvent()

    def release(self, *events: Any) -> None:
        pass
