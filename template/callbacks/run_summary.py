"""A one-paragraph summary at the end of fit, written once by rank zero.

Figures are reduced over all ranks first (on every rank, so the collective never sits
inside a rank-zero-only function), then rank zero writes them.

Example::

    trainer = Trainer(callbacks=[RunSummary()])
    # 12:01:07 INFO fit done in 95.2 s: 3 epochs, 234 steps, 59,904 images over 2 processes,
    #          2,410 images/s while training; val/acc 0.951; best checkpoint runs/...
"""

from __future__ import annotations

import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.data import extract_batch_size

from template.log import get_logger

log = get_logger(__name__)


class RunSummary(pl.Callback):
    """Logs where the run lives at the start of fit and what it achieved at the end."""

    def __init__(self, monitor: str = "val/acc") -> None:
        self.monitor = monitor
        self._images = 0
        self._fit_start = 0.0
        self._val_start = 0.0
        self._val_seconds = 0.0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._images, self._val_seconds = 0, 0.0
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

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._images += extract_batch_size(batch)  # reads a shape: no device access

    def on_validation_start(self, trainer, pl_module) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        self._val_seconds += time.perf_counter() - self._val_start

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        elapsed = time.perf_counter() - self._fit_start
        device = trainer.strategy.root_device
        images = trainer.strategy.reduce(
            torch.tensor(float(self._images), device=device), reduce_op="sum"
        )
        train_seconds = trainer.strategy.reduce(
            torch.tensor(elapsed - self._val_seconds, device=device), reduce_op="max"
        )
        images, train_seconds = int(images.item()), float(train_seconds.item())
        parts = [
            f"fit done in {elapsed:.1f} s: {trainer.current_epoch} epoch(s), "
            f"{trainer.global_step} steps, {images:,} images over {trainer.world_size} "
            f"process(es), {images / max(train_seconds, 1e-9):,.0f} images/s while training"
        ]
        score = trainer.callback_metrics.get(self.monitor)
        if score is not None:
            parts.append(f"{self.monitor} {float(score):.4f}")
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and getattr(ckpt, "best_model_path", ""):
            parts.append(f"best checkpoint {ckpt.best_model_path}")
        log.info("; ".join(parts))
