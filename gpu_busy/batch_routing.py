"""Route a Lightning loop's batches through iterators of your own, stacked in layers.

Lightning's fetcher may call ``iter()`` and ``next()`` on the loop's CombinedLoader with
no hook between, so the loader object gets a subclass whose ``__next__`` reads through
the routed layers, built at the first ``next()`` after each ``iter()``. Each callback owns
a named layer, stacked by ``position`` (0: next to the DataLoader); ``unroute`` removes
one, and the last restores the class.

Example::

    loader = route_batches(trainer.fit_loop, lambda items: TimedReads(items, timer),
                           layer="idle", position=0)
    ...
    unroute(loader, layer="idle")
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from operator import itemgetter
from typing import Any

from gpu_busy import lightning_compat as compat

_routed_classes: dict[type, type] = {}
_by_position = itemgetter(0)  # layers are (position, make_iterator)


def _routed_class(base: type) -> type:
    """``base`` with ``next()`` going through the layers in ``_routing_layers``.

    Single inheritance on purpose: CPython refuses ``__class__`` assignment to a class
    with an extra base (the instance layout check fails).
    """
    if base not in _routed_classes:

        class Routed(base):
            _routing_base = base
            _routing_iterator: Iterator | None = None

            def __iter__(self):
                self._routing_iterator = None
                return base.__iter__(self)

            def __next__(self):
                if self._routing_iterator is None:
                    items = _own_items(self, base)
                    for _, make_iterator in sorted(self._routing_layers.values(), key=_by_position):
                        items = make_iterator(items)
                    self._routing_iterator = items
                return next(self._routing_iterator)

            def reset(self) -> None:
                self._routing_iterator = None
                base.reset(self)

        Routed.__name__ = Routed.__qualname__ = f"Routed{base.__name__}"
        _routed_classes[base] = Routed
    return _routed_classes[base]


def _own_items(loader: Any, base: type) -> Iterator:
    while True:
        try:
            item = base.__next__(loader)
        except StopIteration:
            return
        yield item


def _is_routed(loader: Any) -> bool:
    return "_routing_base" in type(loader).__dict__


def route_batches(
    loop: Any,
    make_iterator: Callable[[Iterator], Iterator],
    *,
    layer: str = "prefetch",
    position: int = 1,
) -> Any | None:
    """From the loop's next pass on, its batches come through ``make_iterator(items)``.

    ``items`` yields what the layer below yields, at the bottom what Lightning's
    CombinedLoader would have yielded, ``(batch, batch_idx, dataloader_idx)``. Layers
    stack by ``position``, lowest next to the DataLoader. Returns the loader (for
    ``unroute``), or None when the loop has no loader yet. Routing the same ``layer``
    again only replaces its ``make_iterator``.
    """
    loader = compat.combined_loader(loop)
    if loader is None:
        return None
    if not _is_routed(loader):
        loader.__class__ = _routed_class(type(loader))
        loader._routing_iterator = None
        loader._routing_layers = {}
    loader._routing_layers[layer] = (position, make_iterator)
    return loader


def unroute(loader: Any, layer: str = "prefetch") -> None:
    """Remove ``layer`` from a loader routed by ``route_batches``; the last one out restores
    the loader's own class."""
    if not _is_routed(loader):
        return
    loader._routing_layers.pop(layer, None)
    if not loader._routing_layers:
        loader.__class__ = type(loader)._routing_base
        for name in ("_routing_iterator", "_routing_layers"):
            loader.__dict__.pop(name, None)


def batches_left_to_read(loop: Any, training: bool) -> int | None:
    """Batches the loop's fetcher will still read in this pass (None: no end known): its
    length, and for training the batch at which ``max_steps`` is reached, plus the
    fetcher's own look-ahead for loaders without a length."""
    length, fetched, lookahead = compat.fetcher_counts(loop)
    ends = [] if length is None else [length]
    trainer = loop.trainer
    if training and (left := batches_until_max_steps(trainer)) is not None:
        done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        ends.append(done + left + lookahead)
    return max(0, min(ends) - fetched) if ends else None


def batches_until_max_steps(trainer: Any) -> int | None:
    """Batches the training loop will still take this epoch before ``max_steps`` (None: no cap).

    Automatic optimisation steps after every ``accumulate_grad_batches``-th batch of the
    epoch and after its last batch; manual optimisation steps when the user says, so it
    cannot be known ahead.
    """
    max_steps = trainer.max_steps
    if max_steps is None or max_steps < 0 or not trainer.lightning_module.automatic_optimization:
        return None
    steps_left = max(0, max_steps - trainer.global_step)
    accumulate = trainer.accumulate_grad_batches
    done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    last = (done // accumulate + steps_left) * accumulate
    n = trainer.num_training_batches
    if n != float("inf") and not trainer.strategy.handles_gradient_accumulation:
        last = min(last, int(n))
    return max(0, last - done)


class Layer:
    """One owner's layer on every loop it routes; ``remove()`` takes it off them all.

    Example::

        layer = Layer("idle", position=0)
        layer.route(trainer.fit_loop, lambda items: TimedReads(items, timer))
        layer.remove()      # at teardown
    """

    def __init__(self, name: str, position: int = 1) -> None:
        self.name, self.position = name, position
        self._loaders: list = []

    def route(self, loop: Any, make_iterator: Callable[[Iterator], Iterator]) -> Any | None:
        """``route_batches`` for this layer; the loader when it is routed here for the
        first time, else None."""
        loader = route_batches(loop, make_iterator, layer=self.name, position=self.position)
        if loader is None or loader in self._loaders:
            return None
        self._loaders.append(loader)
        return loader

    def remove(self) -> None:
        for loader in self._loaders:
            unroute(loader, layer=self.name)
        self._loaders.clear()


class OnReadError(Iterator):
    """A layer that passes items through and, when reading one fails (not the end of
    the items), calls ``handle(error)`` before the error goes on up.

    Example::

        route_batches(loop, lambda items: OnReadError(items, save_if_stopping))
    """

    def __init__(self, items: Iterator, handle: Callable[[Exception], None]) -> None:
        self._items, self._handle = items, handle

    def __next__(self) -> Any:
        try:
            return next(self._items)
        except StopIteration:
            raise
        except Exception as error:
            self._handle(error)
            raise


class EachItem(Iterator):
    """A layer that passes items through and calls ``see(item)`` on each as it is read.

    Example::

        route_batches(loop, lambda items: EachItem(items, detector.memory.batch_from_host))
    """

    def __init__(self, items: Iterator, see: Callable[[Any], None]) -> None:
        self._items, self._see = items, see

    def __next__(self) -> Any:
        item = next(self._items)
        self._see(item)
        return item


class ReadPast(Iterator):
    """A layer that reads past the first ``count`` items (a resumed epoch's batches that
    were trained before the stop), calls ``then()``, and passes the rest through.

    Example::

        route_batches(loop, lambda items: ReadPast(items, 37, restore_generators))
    """

    def __init__(self, items: Iterator, count: int, then: Callable[[], None]) -> None:
        self._items, self._left, self._then = items, count, then

    def __next__(self) -> Any:
        while self._left:
            next(self._items)  # the end of the items ends the epoch, as it would have
            self._left -= 1
        if self._then is not None:
            then, self._then = self._then, None
            then()
        return next(self._items)
