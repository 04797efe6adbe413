"""A TQDM progress bar that reads metrics back from the device only at logging steps.

Lightning converts every ``prog_bar=True`` metric to a number after *every* training step
(an ``.item()``, a host-device sync, per metric per step). Log training metrics without
``prog_bar`` and this bar shows them, read from ``trainer.callback_metrics`` at logging
steps (read back there anyway), in validation and at epoch ends.

Example::

    trainer = Trainer(callbacks=[LoggingStepProgressBar()], log_every_n_steps=20)
    # training_step: self.log("train/loss", loss)     (no prog_bar=True)
"""

from __future__ import annotations

import math

from lightning.pytorch.callbacks import TQDMProgressBar
from torch import Tensor

from gpu_busy import lightning_compat as compat
from gpu_busy.syncs import allow_syncs


class LoggingStepProgressBar(TQDMProgressBar):
    """``TQDMProgressBar`` that shows logged metrics, read only where reading costs nothing new.

    Args:
        refresh_rate: batches between refreshes of the counter.
        leave: keep each epoch's bar on screen.
        metrics: names of logged metrics to show (None: every scalar logged metric,
            without the ``_step``/``_epoch`` duplicates).
    """

    def __init__(
        self, refresh_rate: int = 1, leave: bool = False, metrics: list[str] | None = None
    ) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        self.metrics = metrics
        self._shown: dict[str, float] = {}

    def get_metrics(self, trainer, pl_module) -> dict:
        in_training_step = trainer.training and not trainer.sanity_checking
        if not in_training_step or compat.is_logging_step(trainer):
            self._shown = self._read(trainer)
        # super(): the version number and any prog_bar metric (Lightning converts those)
        return {**super().get_metrics(trainer, pl_module), **self._shown}

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # Once per epoch: shows the epoch-level values (on_epoch=True) Lightning just reduced.
        self._shown = self._read(trainer)
        super().on_train_epoch_end(trainer, pl_module)

    def _read(self, trainer) -> dict[str, float]:
        shown = {}
        for name, value in trainer.callback_metrics.items():
            if self.metrics is None:
                if name.endswith(("_step", "_epoch")):
                    continue
            elif name not in self.metrics:
                continue
            if isinstance(value, Tensor) and value.numel() == 1:
                with allow_syncs("LoggingStepProgressBar reads logged metrics at logging steps"):
                    value = value.item()
            if isinstance(value, (int, float)) and math.isfinite(value):
                shown[name] = value
        return shown
