"""A module that logs with ``sync_dist=True`` under DDP, and a callback that writes what
rank zero's loggers were handed (``logged.json`` in the working directory): the same
values must reach them with the template's bar as with Lightning's
(``tests/whole/test_ddp.py``)."""

from __future__ import annotations

import json

import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel


class SyncDistLogs(BoringModel):
    """prog_bar values reduced over ranks: on the step, on the step and the epoch, and one
    that differs by rank (its mean, 0.5, only after the reduction)."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        loss = out["loss"]
        self.log("pb/loss", loss, prog_bar=True, sync_dist=True)
        self.log("pb/both", loss * 2, prog_bar=True, on_step=True, on_epoch=True, sync_dist=True)
        self.log("pb/rank", float(self.global_rank), prog_bar=True, sync_dist=True)
        return out

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.step(batch), prog_bar=True, sync_dist=True)


class RecordLogged(pl.Callback):
    """Every call to each logger (``handed``: step, metrics) and what checkpointing and
    stopping read at each validation and epoch end (``seen``); at the fit's end, rank zero
    writes both and the callback metrics to ``path`` (None: to no file)."""

    def __init__(self, path: str | None = "logged.json") -> None:
        self.path = path
        self.handed: list = []
        self.seen: list = []

    def setup(self, trainer, pl_module, stage):
        for logger in trainer.loggers:
            original = logger.log_metrics

            def log_metrics(metrics, step=None, original=original):
                self.handed.append([step, dict(metrics)])
                return original(metrics, step)

            logger.log_metrics = log_metrics

    def on_validation_end(self, trainer, pl_module):
        self._see("validation end", trainer)

    def on_train_epoch_end(self, trainer, pl_module):
        self._see("epoch end", trainer)

    def _see(self, when: str, trainer) -> None:
        seen = {k: float(v) for k, v in trainer.callback_metrics.items()}
        self.seen.append([when, trainer.global_step, seen])

    def on_fit_end(self, trainer, pl_module):
        if trainer.is_global_zero and self.path is not None:
            end = {k: float(v) for k, v in trainer.callback_metrics.items()}
            with open(self.path, "w") as f:
                json.dump({"handed": self.handed, "callback_metrics": end}, f)
