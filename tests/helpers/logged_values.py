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
    """Writes ``(step, metrics)`` for every call to each logger, and the callback metrics at
    the fit's end, from rank zero."""

    def __init__(self) -> None:
        self.handed: list = []

    def setup(self, trainer, pl_module, stage):
        for logger in trainer.loggers:
            original = logger.log_metrics

            def log_metrics(metrics, step=None, original=original):
                self.handed.append([step, dict(metrics)])
                return original(metrics, step)

            logger.log_metrics = log_metrics

    def on_fit_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            end = {k: float(v) for k, v in trainer.callback_metrics.items()}
            with open("logged.json", "w") as f:
                json.dump({"handed": self.handed, "callback_metrics": end}, f)
