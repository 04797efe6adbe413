"""StreamPrefetcher: copy batch N+1 to the GPU on a side stream while step N computes.

The loop receives batches already on the device (``gpu_busy.prefetch``), in fit, validate,
test and predict, reading no batch Lightning would not have read; a module that overrides
``on_before_batch_transfer`` or ``transfer_batch_to_device`` owns the copy, and the
prefetcher steps aside saying so. Figures under ``prefetch/``. Details: docs/GUIDE.md,
"Prefetching to the GPU"; docs/ARCHITECTURE.md, "Prefetching batches on a side stream".

Example::

    trainer = Trainer(callbacks=[StreamPrefetcher()])      # depth=1, pins if needed
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

from gpu_busy import batch_routing
from gpu_busy import lightning_compat as compat
from gpu_busy.callbacks.measurement import Measurement
from gpu_busy.callbacks.ranks import gather_rows, log_metrics, over_ranks, publish, run_dir
from gpu_busy.callbacks.step_clock import StepClock
from gpu_busy.log import get_logger
from gpu_busy.prefetch import PrefetchIterator, PrefetchStats, StreamCopier
from gpu_busy.report import prefetch as prefetch_report

log = get_logger(__name__)

_TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device")


class StreamPrefetcher(Measurement):
    """Overlap host-to-device copies with compute by copying ``depth`` batches ahead.

    Args:
        depth: batches copied ahead of the one the step uses (default 1).
        pin_memory: pin batches that arrive in pageable memory, in a background thread
            (a warning says once to set ``pin_memory=True`` on the DataLoader instead).
        log_stats: write the ``prefetch/*`` figures at Lightning's logging steps.
    """

    # Only its figures are a measurement: a batch it cannot move must end the fit
    label, report_name = "prefetch figures", "prefetch"
    measured = frozenset(["window_row", "log_window", "on_train_end"])
    made_per_fit = ("_copier",)

    def __init__(self, depth: int = 1, pin_memory: bool = True, log_stats: bool = True) -> None:
        if depth < 1:
            raise ValueError(f"StreamPrefetcher(depth={depth}): depth must be 1 or more")
        self.depth = depth
        self.pin_memory = pin_memory
        self.log_stats = log_stats
        self.enabled = True
        self.train_stats = PrefetchStats()  # the current logging window
        self.train_total = PrefetchStats()  # the whole fit, all windows
        self.eval_stats = PrefetchStats()
        self.report: dict = {}  # whole-fit figures over all ranks, after fit
        self._copier: StreamCopier | None = None
        self._layer = batch_routing.Layer("prefetch")

    # -- set-up and tear-down ------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(pl_module, pl.LightningModule):
            bases = [
                c.__module__ for c in type(pl_module).__mro__ if c.__name__ == "LightningModule"
            ]
            where = (bases or [type(pl_module).__module__])[0].split(".")[0]
            raise TypeError(
                f"StreamPrefetcher needs lightning.pytorch objects, and the model is a "
                f"{where} LightningModule: import LightningModule and Trainer from "
                "lightning.pytorch (the pytorch_lightning package's classes are others)"
            )
        custom = [
            f"{type(owner).__name__}.{hook}"
            for owner in (pl_module, trainer.datamodule)
            if owner is not None
            for hook in _TRANSFER_HOOKS
            if is_overridden(hook, owner)
        ]
        self.enabled = not custom
        if custom:
            log.warning(
                "StreamPrefetcher is off: %s override(s) a transfer hook that expects host "
                "batches. Move host work into the Dataset/collate_fn and device work into "
                "on_after_batch_transfer to prefetch.",
                ", ".join(custom),
            )
            return
        if self._copier is None or self._copier.device != _device(trainer):
            # Timings are read once per logging window: room for two windows (3 a batch)
            window = max(1, trainer.log_every_n_steps) * max(1, trainer.accumulate_grad_batches)
            self._copier = StreamCopier(
                _device(trainer), pin_memory=self.pin_memory, timing_events=6 * window + 64
            )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._layer.remove()
        if (clock := StepClock.of(trainer)) is not None:
            clock.remove(trainer)
        if self._copier is not None:
            self._copier.close()

    # -- routing each loop's batches through the prefetcher -------------------------

    def on_train_start(self, trainer, pl_module) -> None:
        self._route(trainer.fit_loop, self.train_stats, training=True)
        if self.enabled and self._copier is not None:
            StepClock.subscribe(trainer, self)  # the figures ride the fit's one window

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        # reload_dataloaders_every_n_epochs gives the loop a new loader
        self._route(trainer.fit_loop, self.train_stats, training=True)

    def on_validation_start(self, trainer, pl_module) -> None:
        fitting = trainer.state.fn == "fit"  # validation inside fit, sanity check included
        loop = trainer.fit_loop.epoch_loop.val_loop if fitting else trainer.validate_loop
        self._route(loop, self.eval_stats)

    def on_test_start(self, trainer, pl_module) -> None:
        self._route(trainer.test_loop, self.eval_stats)

    def on_predict_start(self, trainer, pl_module) -> None:
        self._route(trainer.predict_loop, self.eval_stats)

    def _route(self, loop, stats: PrefetchStats, training: bool = False) -> None:
        if not self.enabled or self._copier is None:
            return

        def make_iterator(items):
            limit = batch_routing.batches_left_to_read(loop, training)  # no more than Lightning's
            # a loader without a length: Lightning's fetcher reads ahead itself, and a loader
            # that writes on the module as it yields must be read no earlier than without us
            _, _, held = compat.fetcher_counts(loop)
            return PrefetchIterator(items, self._copier, depth=self.depth, limit=limit,
                                    stats=stats, held=held)  # fmt: skip

        if self._layer.route(loop, make_iterator) is not None:  # newly routed
            # Read before the loader was routed (Lightning's look-ahead for a loader without
            # a length): moved here, so that every batch reaches the step the same way.
            held = compat.fetched_ahead(loop)
            for i, item in enumerate(held):
                stats.batches += 1
                held[i] = self._copier.finish(self._copier.start(item), stats)

    # -- figures ---------------------------------------------------------------------

    def window_row(self) -> list[float]:
        self._copier.poll()  # the window's copy timings: read here, not per batch
        window = self.train_stats.take()
        self.train_total.add(window)
        return window.as_list()

    def log_window(self, trainer: pl.Trainer, rows: list[list[float]]) -> None:
        if self.log_stats:
            per_rank = [PrefetchStats.from_list(r).means() for r in rows]
            log_metrics(trainer, over_ranks(per_rank, prefix="prefetch/"))

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._copier is not None:
            self._copier.poll()

    on_test_end = on_predict_end = on_validation_end

    def on_train_end(self, trainer, pl_module) -> None:
        if not self.enabled or self._copier is None:
            return
        self._copier.poll(block=True)  # training is over: waiting costs nothing now
        self.train_total.add(self.train_stats.take())
        per_rank = self._per_rank(trainer, self.train_total)
        total = PrefetchStats()
        for stats in per_rank:
            total.add(stats)
        folder = run_dir(trainer)  # every rank asks: a broadcast under DDP
        self.report, lines = prefetch_report.end_of_fit(total)
        if total.batches:
            publish(trainer, "prefetch", self.report, lines, folder)

    @staticmethod
    def _per_rank(trainer: pl.Trainer, stats: PrefetchStats) -> list[PrefetchStats]:
        return [PrefetchStats.from_list(r) for r in gather_rows(trainer, stats.as_list())]


def _device(trainer: pl.Trainer) -> torch.device:
    return trainer.strategy.root_device
