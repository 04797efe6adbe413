"""A DataLoader worker forked after the measuring began must not die of what it inherited.

On a GPU machine, bench's second fit in one process lost all 8 workers ("CUDA error:
initialization error" in terminate()): the first fit's recorded timing events sat in
reference cycles, each worker's first collection freed them, and an event's destructor
calls CUDA, which a forked child cannot. Here a stand-in event aborts the process as that
destructor does when it runs in a child, and the workers collect garbage on every item.
"""

from __future__ import annotations

import gc
import os

import torch
from torch.utils.data import DataLoader, Dataset

from gpu_busy.event_pool import EventPool


class _EventStandIn:
    """``torch.cuda.Event`` as a forked child meets it: its destructor kills the process."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.made_in = os.getpid()

    def __del__(self) -> None:
        if os.getpid() != self.made_in:
            os.abort()  # c10::cuda::ExchangeDevice throws inside a destructor: terminate()


class _CollectingEachItem(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        gc.collect()  # what any allocation-heavy worker does sooner or later
        return torch.tensor(i)


class _Finished:
    """A finished fit's timing state in a cycle, as a Trainer and its callbacks are."""

    def __init__(self, pool: EventPool) -> None:
        self.pool, self.me = pool, self
        self.events = [pool.acquire(), pool.acquire()]


def test_workers_forked_with_events_in_uncollected_garbage_live(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _EventStandIn)
    gc.collect()
    gc.disable()  # keep the cycle uncollected here until the workers are forked
    try:
        _Finished(EventPool(capacity=4))
        loader = DataLoader(
            _CollectingEachItem(), batch_size=2, num_workers=2, multiprocessing_context="fork"
        )
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    finally:
        gc.enable()
        gc.collect()
