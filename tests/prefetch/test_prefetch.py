"""The prefetch mechanism alone (gpu_busy.prefetch), on the CPU path."""

from __future__ import annotations

import contextlib
import time
from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch

from gpu_busy.event_pool import EventPool
from gpu_busy.prefetch import InFlightBatch, PrefetchIterator, PrefetchStats, StreamCopier


class CountingSource:
    """An iterator over ``n`` tensors that records how many were read."""

    def __init__(self, n: int, delay: float = 0.0) -> None:
        self.n, self.delay, self.reads = n, delay, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.reads >= self.n:
            raise StopIteration
        time.sleep(self.delay)
        self.reads += 1
        return torch.full((2, 3), float(self.reads - 1))


@pytest.fixture
def copier():
    return StreamCopier("cpu")


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_yields_every_item_once_in_order_with_identical_values(copier, depth):
    items = list(PrefetchIterator(CountingSource(7), copier, depth=depth))
    assert [int(t[0, 0]) for t in items] == list(range(7))
    assert all(torch.equal(t, torch.full((2, 3), float(i))) for i, t in enumerate(items))


@pytest.mark.parametrize("depth", [1, 2])
def test_reads_depth_items_ahead_of_the_consumer(copier, depth):
    source = CountingSource(6)
    it = PrefetchIterator(source, copier, depth=depth)
    reads_when_handed = []
    for _ in it:
        reads_when_handed.append(source.reads)
    # When item k is handed out, items k+1..k+depth have already been read (and moved).
    assert reads_when_handed == [min(k + 1 + depth, 6) for k in range(6)]


class OrderedCopier:
    """A copier that writes down, in order, each copy issued and each wait queued on the
    compute stream: what a CUDA copier does at ``start`` and ``finish``."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start(self, item):
        self.calls.append(f"copy {int(item[0, 0])}")
        return InFlightBatch(item)

    def finish(self, in_flight, stats):
        self.calls.append(f"wait {int(in_flight.batch[0, 0])}")
        return in_flight.batch


def test_under_a_reader_that_holds_one_the_source_is_read_no_further_ahead():
    """Lightning's fetcher, for a loader without a length, reads one batch into its hold at
    ``iter()``, and for each step pops the batch the step takes and reads the next: the
    copy starts at that read, a step ahead, and the wait is queued as the batch leaves the
    hold, just before its step; the source is read as far as without the prefetcher."""
    source, ordered = CountingSource(3), OrderedCopier()
    batches = PrefetchIterator(source, ordered, depth=1, held=1)
    hold, step = [next(batches)], 0
    while hold:
        taken = hold.pop(0)
        with contextlib.suppress(StopIteration):
            hold.append(next(batches))
        assert int(taken[0, 0]) == step and source.reads == min(step + 2, 3)
        ordered.calls.append(f"step {step}")
        step += 1
    assert ordered.calls == ["copy 0", "copy 1", "wait 0", "step 0", "copy 2", "wait 1",
                             "step 1", "wait 2", "step 2"]  # fmt: skip


def test_limit_caps_reads_from_the_source(copier):
    source = CountingSource(10)
    items = list(PrefetchIterator(source, copier, depth=2, limit=4))
    assert len(items) == 4 and source.reads == 4


def test_limit_zero_reads_nothing(copier):
    source = CountingSource(3)
    assert list(PrefetchIterator(source, copier, limit=0)) == [] and source.reads == 0


def test_empty_source_stops_at_once(copier):
    assert list(PrefetchIterator(iter([]), copier)) == []


def test_depth_must_be_positive(copier):
    with pytest.raises(ValueError, match="depth must be at least 1"):
        PrefetchIterator(iter([]), copier, depth=0)


Pair = namedtuple("Pair", "image label")


@dataclass
class Sample:
    pixels: torch.Tensor
    names: list[str]
    meta: dict


def test_collections_keep_their_shape_and_non_tensor_fields(copier):
    names = ["a", "b"]
    batch = {
        "pair": Pair(torch.ones(2), torch.tensor([1, 2])),
        "list": [torch.zeros(1), "text", 3, None],
        "tuple": (torch.arange(3), 2.5),
        "sample": Sample(torch.ones(2, 2), names, {"id": 7, "w": torch.ones(1)}),
    }
    (out,) = list(PrefetchIterator(iter([batch]), copier))
    assert isinstance(out["pair"], Pair) and torch.equal(out["pair"].label, torch.tensor([1, 2]))
    assert out["list"][1:] == ["text", 3, None]
    assert out["tuple"][1] == 2.5 and torch.equal(out["tuple"][0], torch.arange(3))
    assert isinstance(out["sample"], Sample)
    assert out["sample"].names == names and out["sample"].meta["id"] == 7
    assert torch.equal(out["sample"].meta["w"], torch.ones(1))


@pytest.mark.parametrize("walk", ["pytree", "apply_to_collection"])
def test_one_walk_finds_every_tensor_and_rebuilds_the_batch_around_new_ones(walk):
    from lightning_utilities.core.apply_func import apply_to_collection

    from gpu_busy.prefetch import _Leaves

    batch = {
        "pair": Pair(torch.ones(2), torch.tensor([1, 2])),
        "list": [torch.zeros(1), "text", 3, None],
        "tuple": (torch.arange(3), 2.5),
    }
    if walk == "apply_to_collection":  # a dataclass leaf: pytree cannot see inside it
        batch["sample"] = Sample(torch.ones(2, 2), ["a"], {"w": torch.ones(1)})
    leaves = _Leaves(batch)
    expected = []
    apply_to_collection(batch, torch.Tensor, expected.append)
    assert [id(t) for t in leaves.tensors] == [id(t) for t in expected]
    assert leaves.mover is None
    doubled = leaves.rebuild([t * 2 for t in leaves.tensors])
    reference = apply_to_collection(batch, torch.Tensor, lambda t: t * 2)
    flat = lambda b: apply_to_collection(b, torch.Tensor, lambda t: t.tolist())  # noqa: E731
    assert flat(doubled) == flat(reference) and isinstance(doubled["pair"], Pair)


@pytest.mark.parametrize("kind", [tuple, list])
def test_plain_containers_are_walked_by_hand_and_rebuilt_as_the_same_kinds(kind, monkeypatch):
    """Lightning hands the prefetcher ``(batch, batch_idx, dataloader_idx)``: lists, tuples
    and dicts of tensors and numbers skip pytree, and come back as they went in."""
    import gpu_busy.prefetch as prefetch

    def no_pytree(*args):
        raise AssertionError("pytree walked a plain batch")

    monkeypatch.setattr(prefetch, "tree_flatten", no_pytree)
    inner = kind([torch.ones(2), {"y": torch.tensor([1, 2]), "n": [3, None, "s", True]}])
    batch = (inner, 7, 0)
    leaves = prefetch._Leaves(batch)
    assert [id(t) for t in leaves.tensors] == [id(inner[0]), id(inner[1]["y"])]
    assert leaves.mover is None
    doubled = leaves.rebuild([t * 2 for t in leaves.tensors])
    assert type(doubled) is tuple and doubled[1:] == (7, 0) and type(doubled[0]) is kind
    assert doubled[0][0].tolist() == [2, 2] and doubled[0][1]["y"].tolist() == [2, 4]
    assert doubled[0][1]["n"] == [3, None, "s", True]


def test_batches_and_copies_are_counted(copier):
    stats = PrefetchStats()
    list(PrefetchIterator(CountingSource(4, delay=0.02), copier, stats=stats))
    m = stats.means()
    assert stats.batches == 4 and stats.copies == 4 and m["copy_ms"] is not None
    # No device events on a CPU: the exposed share is not available, never made up.
    assert m["exposed_copy_ms"] is None and m["hidden_copy_pct"] is None


def test_cpu_path_creates_no_cuda_objects(copier, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a CUDA object was created on the CPU path")

    monkeypatch.setattr(torch.cuda, "Stream", boom)
    monkeypatch.setattr(torch.cuda, "Event", boom)
    assert len(list(PrefetchIterator(CountingSource(3), copier))) == 3
    assert copier._stream is None


def test_stats_take_add_and_round_trip():
    s = PrefetchStats(batches=2, copies=2, copy_ms=1.0)
    window = s.take()
    assert window.batches == 2 and s.batches == 0 and s.copy_ms == 0.0
    total = PrefetchStats()
    total.add(window)
    total.add(window)
    assert total.batches == 4 and total.copy_ms == 2.0
    assert PrefetchStats.from_list(total.as_list()) == total
    assert PrefetchStats().means()["copy_ms"] is None


def lent(pool: EventPool) -> int:
    """Events ``pool`` has lent and not had back, by its public calls: its capacity less
    what it can still lend."""
    free = []
    while (event := pool.acquire()) is not None:
        free.append(event)
    pool.release(*free)
    return pool.capacity - len(free)


def test_event_pool_is_bounded(monkeypatch):
    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.timing = enable_timing

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    pool = EventPool(capacity=2)
    a, b = pool.acquire(), pool.acquire()
    assert a.timing and b.timing and pool.acquire() is None and lent(pool) == 2
    pool.release(a, None)
    assert pool.acquire() is a
    with pytest.raises(ValueError):
        EventPool(capacity=0)


def test_close_gives_the_events_of_unread_copies_back_to_the_pool():
    class Pool:
        def __init__(self):
            self.released = []

        def release(self, *events):
            self.released.extend(events)

    copier = StreamCopier("cpu")
    copier._events = Pool()
    copier._pending.extend([("start", "end", "reached", None), ("s2", "e2", "r2", None)])
    copier.close()
    assert copier._events.released == ["start", "end", "reached", "s2", "e2", "r2"]
    assert not copier._pending


def test_fits_that_stop_early_give_their_in_flight_copies_events_back(monkeypatch):
    """An iterator abandoned mid-epoch (early stopping, an exception) holds the timing
    events of the copies it issued but never handed over; the copier's close frees them,
    fit after fit. The CUDA calls are stand-ins: only the bookkeeping runs here."""
    import contextlib

    import gpu_busy.prefetch as prefetch

    class FakeEvent:
        def __init__(self, enable_timing=False):
            pass

        def record(self, stream=None):
            pass

        def query(self):
            return True

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 1.0

    class FakeStream:
        def wait_event(self, event):
            pass

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(prefetch.StreamCopier, "_moved", lambda self, t, non_blocking: t)
    copier = StreamCopier("cuda:0", pin_memory=False, timing_events=8)
    copier._stream = FakeStream()
    for _fit in range(3):
        batches = PrefetchIterator([torch.ones(2)] * 6, copier, depth=2)
        next(batches)  # the fit stops after one step: two copies still in flight
        del batches
        copier.close()  # the callback's teardown
        assert lent(copier._events) == 0
    assert copier._events._created <= 8


class _Storage:
    """Where PyTorch Geometric keeps a graph's fields: a dict in an attribute."""

    def __init__(self, fields: dict) -> None:
        self._mapping = fields


class Graph:
    """A batch class that behaves like PyTorch Geometric's ``Batch``: its fields in a
    storage, a ``.to(device, *args, non_blocking=False)`` that copies each field, and a
    ``pin_memory()`` (what the DataLoader's ``pin_memory=True`` calls)."""

    moved_on_side_stream: list[bool] = []

    def __init__(self, **fields: torch.Tensor) -> None:
        self._store = _Storage(fields)

    def __getattr__(self, name: str) -> torch.Tensor:
        return self.__dict__["_store"]._mapping[name]

    def to(self, device, *args, non_blocking: bool = False) -> Graph:
        from gpu_busy.cuda_runtime import runtime

        Graph.moved_on_side_stream.append(getattr(runtime(), "on_side_stream", False))
        fields = self._store._mapping.items()
        return Graph(**{k: v.to(device, non_blocking=non_blocking) for k, v in fields})

    def pin_memory(self) -> Graph:
        return Graph(**{k: v.pin_memory() for k, v in self._store._mapping.items()})


def _graphs(n: int) -> list:
    return [
        (Graph(x=torch.randn(5, 3), edge_index=torch.randint(0, 5, (2, 8)),
               batch=torch.zeros(5, dtype=torch.long)), i, 0)
        for i in range(n)
    ]  # fmt: skip


def test_a_batch_object_whose_to_takes_non_blocking_is_prefetched_not_left_to_lightning():
    stats = PrefetchStats()
    out = list(PrefetchIterator(_graphs(3), StreamCopier("cpu"), stats=stats))
    assert stats.unmoved_batches == 0 and stats.copies == stats.batches == 3
    assert all(isinstance(g, Graph) and g.x.shape == (5, 3) for g, _, _ in out)


def test_a_batch_object_moves_on_the_side_stream_and_each_field_is_kept_for_the_step():
    """Along the CUDA route (the counting stand-in): the object's own .to runs inside the
    side stream, and every tensor it holds after the move gets record_stream."""
    from bench.cuda_calls import CountingCuda
    from gpu_busy.cuda_runtime import replaced_by

    Graph.moved_on_side_stream = []
    with replaced_by(CountingCuda(lambda: ("test", "steady"))) as cuda:
        copier = StreamCopier("cpu", pin_memory=False)
        out = list(PrefetchIterator(_graphs(2), copier, stats=PrefetchStats()))
        copier.close()
    assert len(out) == 2 and Graph.moved_on_side_stream == [True, True]
    calls = {kind: n for (_, _, kind), n in cuda.counts.items()}
    assert calls["record_stream"] == 2 * 3  # x, edge_index, batch of each graph
    assert calls["is_pinned"] == 2  # one a graph: its first pinned tensor tells


@pytest.mark.parametrize("route", ["host", "cuda route"])
def test_a_move_onto_the_host_device_hands_over_new_tensors_of_the_same_memory(route):
    """As a copy to a GPU does: the step never gets the DataLoader's tensor objects, which
    the sync detector's CPU simulation keeps as host memory (by identity)."""
    from bench.cuda_calls import CountingCuda
    from gpu_busy.cuda_runtime import replaced_by

    (graph, _, _), plain = _graphs(1)[0], torch.randn(4, 2)
    fields = {id(t) for t in graph._store._mapping.values()}
    standin = CountingCuda(lambda: ("test", "steady")) if route == "cuda route" else None
    with replaced_by(standin) if standin else contextlib.nullcontext():
        copier = StreamCopier("cpu", pin_memory=False)
        ((moved_graph, moved_plain),) = PrefetchIterator([(graph, plain)], copier)
        copier.close()
    assert moved_plain is not plain and moved_plain.data_ptr() == plain.data_ptr()
    assert not fields & {id(t) for t in moved_graph._store._mapping.values()}
    assert torch.equal(moved_graph.x, graph.x)


def test_a_leaf_whose_to_takes_no_non_blocking_is_still_left_to_lightning():
    from gpu_busy.prefetch import _Leaves

    class Blocks:
        def to(self, device):
            return self

    leaves = _Leaves((Blocks(), 0, 0))
    assert leaves.mover is Blocks and leaves.objects == []
    graph = _graphs(1)[0]
    assert _Leaves(graph).mover is None and _Leaves(graph).objects == [graph[0]]


def test_pytorch_geometrics_own_batch_is_prefetched_with_each_field_kept():
    pyg = pytest.importorskip("torch_geometric.data")
    from bench.cuda_calls import CountingCuda
    from gpu_busy.cuda_runtime import replaced_by
    from gpu_busy.syncs.memory import held_tensors

    graphs = [
        pyg.Data(x=torch.randn(4, 3), edge_index=torch.tensor([[0, 1, 2], [1, 2, 3]]))
        for _ in range(2)
    ]
    batch = pyg.Batch.from_data_list(graphs)  # x, edge_index, batch, ptr
    with replaced_by(CountingCuda(lambda: ("test", "steady"))) as cuda:
        copier = StreamCopier("cpu", pin_memory=False)
        stats = PrefetchStats()
        ((moved, _, _),) = list(PrefetchIterator([(batch, 0, 0)], copier, stats=stats))
        copier.close()
    assert stats.unmoved_batches == 0 and torch.equal(moved.x, batch.x)
    calls = {kind: n for (_, _, kind), n in cuda.counts.items()}
    # every field .to moves (x, edge_index, batch, ptr); its slice dicts too where the stand-in
    # keeps them on "the device" (on a GPU they stay on the host, and are left out)
    fields = [v for v in moved.to_dict().values() if isinstance(v, torch.Tensor)]
    assert calls["record_stream"] == len(held_tensors(moved)) >= len(fields) == 4


def test_an_object_pinned_by_its_own_pin_memory_is_not_pinned_again():
    """PyTorch Geometric's pin_memory() pins the fields, not its slice dicts: the object
    counts as pinned (any tensor pinned), a wholly pageable one does not."""
    from bench.cuda_calls import CountingCuda
    from gpu_busy.cuda_runtime import replaced_by
    from gpu_busy.prefetch import _Leaves, _pageable

    class PinnedWhere(CountingCuda):
        pinned: set[int] = set()

        def is_pinned(self, tensor):
            return tensor.data_ptr() in self.pinned

    (graph, _, _) = _graphs(1)[0]
    graph.bookkeeping = {"slices": torch.arange(3)}  # never pinned by its pin_memory()
    with replaced_by(PinnedWhere(lambda: ("test", "steady"))) as cuda:
        assert _pageable(_Leaves((graph, 0, 0)))  # nothing pinned yet
        cuda.pinned = {graph.x.data_ptr(), graph.edge_index.data_ptr(), graph.batch.data_ptr()}
        assert not _pageable(_Leaves((graph, 0, 0)))
