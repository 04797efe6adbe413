"""The one place the template reads Lightning internals.

Each private attribute below is pinned by ``tests/test_lightning_compat.py``: when a
Lightning release renames one, that test fails with the name, instead of the template
silently misbehaving.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl


def is_logging_step(trainer: pl.Trainer) -> bool:
    """True in the training step whose metrics Lightning will send to the loggers.

    Lets a module do a costly reduction (a collective, a host read) only on the steps
    where the result is written, every ``log_every_n_steps``.
    """
    # Private: Trainer._logger_connector.should_update_logs (Lightning 2.0 to 2.6), the
    # property Lightning itself consults before calling the loggers.
    return bool(trainer._logger_connector.should_update_logs)


def logger_step(trainer: pl.Trainer) -> int:
    """The step number Lightning passes to the loggers, so rows written directly line up."""
    # Private: _TrainingEpochLoop._batches_that_stepped (Lightning 2.0 to 2.6), what
    # _LoggerConnector.log_metrics uses as ``step``.
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def epoch_position(trainer: pl.Trainer) -> tuple[int, int]:
    """``(epoch, batches of it trained)`` for the next training batch, read while a
    checkpoint is written.

    From a mid-epoch save (``on_train_batch_end``, a mid-epoch validation) that is the
    current epoch and the batches run so far, the one just trained included; from an
    epoch-end save it is ``(next epoch, 0)``.
    """
    # Public attributes, but what ``processed`` means at save time (the batch that just ran
    # is counted; ``completed`` is not yet) is Lightning's loop bookkeeping (2.0 to 2.6),
    # pinned by tests/test_lightning_compat.py and tests/test_resume.py.
    trained = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
    epoch = int(trainer.current_epoch)
    if trained >= trainer.num_training_batches:
        return epoch + 1, 0
    return epoch, trained


def fetcher_counts(loop: Any) -> tuple[int | None, int, int]:
    """``(length, fetched, lookahead)`` of the loop's data fetcher in the current pass.

    Lightning's fetcher stops asking its CombinedLoader for batches once ``fetched``
    reaches ``length`` (None for loaders without one); there it keeps ``lookahead``
    batches ahead of what the loop has consumed. ``fetched`` includes the batches a
    resumed epoch skipped, so it is on the same scale as the loop's ``batch_progress``.
    """
    # Private: loop._data_fetcher and its .length / .fetched / .prefetch_batches
    # (Lightning 2.1 to 2.6).
    fetcher = loop._data_fetcher
    length = None if fetcher.length is None else int(fetcher.length)
    lookahead = 0 if length is not None else int(getattr(fetcher, "prefetch_batches", 0))
    return length, int(fetcher.fetched), lookahead


# -- routing a loop's batches through iterators ---------------------------------------
#
# Lightning's fetchers call ``next()`` on the loop's CombinedLoader (``iter()`` returns
# the loader itself) and create a fresh inner iterator on every ``iter()``, sometimes
# with no callback hook between that ``iter()`` and the first ``next()``. So a callback
# cannot swap an iterator in from a hook; instead the CombinedLoader object gets a
# subclass whose ``__next__`` pulls its own items through the routed layers, built
# lazily at the first ``next()`` after each ``iter()``. Several callbacks can route the
# same loader: each owns a named layer, stacked by ``position`` (0 is next to the
# DataLoader). ``unroute`` removes a layer, and restores the original class with the last.


_routed_classes: dict[type, type] = {}


def _routed_class(base: type) -> type:
    """``base`` with ``next()`` going through the layers in ``_tpl_layers``.

    Single inheritance on purpose: CPython refuses ``__class__`` assignment to a class
    with an extra base (the instance layout check fails).
    """
    if base not in _routed_classes:

        class Routed(base):
            _tpl_base = base
            _tpl_iterator: Iterator | None = None

            def __iter__(self):
                self._tpl_iterator = None
                return base.__iter__(self)

            def __next__(self):
                if self._tpl_iterator is None:
                    items = _own_items(self, base)
                    for _, make_iterator in sorted(self._tpl_layers.values(), key=_position):
                        items = make_iterator(items)
                    self._tpl_iterator = items
                return next(self._tpl_iterator)

            def reset(self) -> None:
                self._tpl_iterator = None
                base.reset(self)

        Routed.__name__ = Routed.__qualname__ = f"Routed{base.__name__}"
        _routed_classes[base] = Routed
    return _routed_classes[base]


def _position(layer: tuple[int, Callable]) -> int:
    return layer[0]


def _own_items(loader: Any, base: type) -> Iterator:
    while True:
        try:
            item = base.__next__(loader)
        except StopIteration:
            return
        yield item


def _is_routed(loader: Any) -> bool:
    return "_tpl_base" in type(loader).__dict__


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
    # Private: loop._combined_loader (Lightning 2.0 to 2.6), the loader the loop's
    # fetcher iterates.
    loader = getattr(loop, "_combined_loader", None)
    if loader is None:
        return None
    if not _is_routed(loader):
        loader.__class__ = _routed_class(type(loader))
        loader._tpl_iterator = None
        loader._tpl_layers = {}
    loader._tpl_layers[layer] = (position, make_iterator)
    return loader


def unroute(loader: Any, layer: str = "prefetch") -> None:
    """Remove ``layer`` from a loader routed by ``route_batches``; the last one out restores
    the loader's own class."""
    if not _is_routed(loader):
        return
    loader._tpl_layers.pop(layer, None)
    if not loader._tpl_layers:
        loader.__class__ = type(loader)._tpl_base
        for name in ("_tpl_iterator", "_tpl_layers"):
            loader.__dict__.pop(name, None)


def throttle_sigterm_broadcast(trainer: pl.Trainer, due: Callable[[], bool]) -> Callable[[], None]:
    """Make the training loop's per-step SIGTERM broadcast run only when ``due()`` says.

    ``due`` must answer the same on every rank at the same step (it gates a collective).
    Returns a function that restores Lightning's own behaviour.
    """
    loop = trainer.fit_loop.epoch_loop
    # Private: _TrainingEpochLoop._broadcast_sigterm_tensor (Lightning 2.5.2 to 2.6), called
    # at the start of advance() under DDP. Older releases have no per-step check.
    original = getattr(type(loop), "_broadcast_sigterm_tensor", None)
    if original is None:
        return lambda: None

    def broadcast_when_due() -> None:
        if due():
            original(loop)

    loop._broadcast_sigterm_tensor = broadcast_when_due

    def undo() -> None:
        loop.__dict__.pop("_broadcast_sigterm_tensor", None)

    return undo


def child_exit_codes(trainer: pl.Trainer) -> dict[int, int | None]:
    """``{global rank: return code or None while running}`` of the ranks this process
    started (Lightning's launcher starts a node's other ranks from its local rank zero);
    empty where processes were started by something else (torchrun, SLURM)."""
    # Undocumented: _SubprocessScriptLauncher.procs (Lightning 2.0 to 2.6), the Popen of
    # local ranks 1..n-1 in order.
    if trainer.local_rank != 0:
        return {}
    procs = getattr(trainer.strategy.launcher, "procs", None) or []
    first = trainer.node_rank * trainer.num_devices
    return {first + i + 1: proc.poll() for i, proc in enumerate(procs)}
