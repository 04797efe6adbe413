"""BestCheckpoint: keep the best checkpoint by a logged metric, when the model logs it.

Lightning's ``ModelCheckpoint(monitor=...)`` stops the fit with an exception when the
monitored metric was never logged after validation ran: swapping in a model that logs
under another name then costs the run. This one says so once and keeps no "best"; other
checkpoint callbacks (``last.ckpt``) go on as usual.

Example::

    trainer = Trainer(callbacks=[BestCheckpoint(monitor="val/acc", mode="max")])
"""

from __future__ import annotations

import lightning.pytorch as pl

from gpu_busy import lightning_compat as compat
from gpu_busy.log import get_logger

log = get_logger(__name__)


class BestCheckpoint(compat.SaveGatedCheckpoint, compat.Callback):
    """``ModelCheckpoint`` that skips its saves while ``monitor`` has not been logged."""

    _warned = False
    _validated = False  # a validation (not the sanity check) has run in this fit

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._validated = False

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._validated = True
        super().on_validation_end(trainer, pl_module)

    def save_due(self, trainer: pl.Trainer, monitor_candidates: dict) -> bool:
        # Asked at saves only: reading trainer.callback_metrics at every batch would convert
        # each prog_bar metric there.
        if self.monitor is None or self.monitor in monitor_candidates:
            return True
        # A metric logged in validation only (the usual case) is missing until the first
        # validation: say nothing before one has run, where the fit validates at all.
        if not self._warned and (self._validated or not trainer.enable_validation):
            self._warned = True
            log.warning(
                "no best checkpoint: the model never logged %r (the monitor of the best "
                "checkpoint in the config); log it with self.log or change the monitor. "
                "Other checkpoints (last.ckpt) are written as usual",
                self.monitor,
            )
        return False
