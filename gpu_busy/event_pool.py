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

import threading

import torch


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

    @property
    def in_use(self) -> int:
        return self._created - len(self._free)

    def acquire(self) -> torch.cuda.Event | None:
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._created >= self.capacity:
                return None
            self._created += 1
        return torch.cuda.Event(enable_timing=True)

    def release(self, *events: torch.cuda.Event | None) -> None:
        with self._lock:
            self._free.extend(e for e in events if e is not None)
