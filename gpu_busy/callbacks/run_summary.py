"""A one-paragraph summary at the end of fit, written once by rank zero.

Figures are reduced over all ranks first (on every rank, so the collective never sits
inside a rank-zero-only function), then rank zero writes them. The score it reports is
the one the best-checkpoint callback monitors (``ModelCheckpoint(monitor=...)``), so the
metric that judges a run is named in one place.

Example::

    trainer = Trainer(callbacks=[RunSummary()])
    # 12:01:07 INFO fit done in 95.2 s: 3 epochs, 234 steps, 59,904 samples over 2 processes,
    #          2,410 samples/s while training; val/acc 0.951; best checkpoint runs/...
"""

from __future__ import annotations

import time

import lightning.pytorch as pl
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.data import extract_batch_size

from gpu_busy.callbacks.ranks import gather_rows
from gpu_busy.log import get_logger

log = get_logger(__name__)


class RunSummary(pl.Callback):
    """Logs where the run lives at the start of fit and what it achieved at the end."""

    def __init__(self) -> None:
        self._samples = 0  # -1 once a batch had no size Lightning could find
        self._first_step = 0
        self._fit_start = 0.0
        self._val_start = 0.0
        self._val_seconds = 0.0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._samples, self._val_seconds = 0, 0.0
        self._fit_start = time.perf_counter()
        # trainer.log_dir is broadcast from rank zero: the same directory on every rank.
        log_dir = trainer.log_dir
        log.info(
            "run directory %s; %d process(es) on %s, precision %s",
            log_dir,
            trainer.world_size,
            trainer.strategy.root_device.type,
            trainer.precision,
        )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_step = trainer.global_step  # not 0 in a resumed run

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._samples < 0:
            return
        try:
            self._samples += extract_batch_size(batch)  # reads a shape: no device access
        except MisconfigurationException:  # a batch Lightning cannot size: count steps
            self._samples = -1

    def on_validation_start(self, trainer, pl_module) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        self._val_seconds += time.perf_counter() - self._val_start

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        elapsed = time.perf_counter() - self._fit_start
        rows = gather_rows(trainer, [self._samples, elapsed - self._val_seconds])
        countable = all(r[0] >= 0 for r in rows)
        samples = int(sum(r[0] for r in rows))
        train_seconds = max(max(r[1] for r in rows), 1e-9)  # the longest of the ranks
        steps = trainer.global_step - self._first_step
        resumed = f", resumed at step {self._first_step}" if self._first_step else ""
        rate = (
            f"{samples:,} samples, {samples / train_seconds:,.0f} samples/s while training"
            if countable
            else f"{steps / train_seconds:,.2f} steps/s while training"
        )
        parts = [
            f"fit done in {elapsed:.1f} s: {trainer.current_epoch} epoch(s), {steps} steps"
            f"{resumed} over {trainer.world_size} process(es), {rate}"
        ]
        if self._first_step and trainer.ckpt_path:
            parts.append(f"earlier steps: see the run that wrote {trainer.ckpt_path}")
        best = _best_checkpoint(trainer)
        if best is not None:
            score = trainer.callback_metrics.get(best.monitor)
            if score is not None:
                parts.append(f"{best.monitor} {float(score):.4f}")
            if best.best_model_path:
                parts.append(f"best checkpoint {best.best_model_path}")
        log.info("; ".join(parts))


def _best_checkpoint(trainer: pl.Trainer) -> ModelCheckpoint | None:
    """The first checkpoint callback that keeps the best by a monitored metric."""
    return next(
        (c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.monitor),
        None,
    )
