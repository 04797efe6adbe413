"""CheckpointRngState: checkpoints carry every rank's random generator states.

Lightning restores weights, optimizer, schedulers and loop counters, not the random
generators. This callback gathers every rank's into the checkpoint and puts each back on
its rank right before the resumed run's first batch (after the sanity check). With a
``ResumableSampler`` this makes a resumed run end with the weights of one that never
stopped. Details: docs/ARCHITECTURE.md, "Exact resume".

Example::

    trainer = Trainer(callbacks=[CheckpointRngState()])
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from gpu_busy import lightning_compat as compat
from gpu_busy.log import get_logger
from gpu_busy.resume.rng_state import capture_rng_state, restore_rng_state
from gpu_busy.syncs import allow_syncs

log = get_logger(__name__)


class CheckpointRngState(compat.Callback):
    """Save each rank's generator states with every checkpoint; restore them on resume."""

    def __init__(self) -> None:
        self._trainer: pl.Trainer | None = None
        self._to_restore: torch.Tensor | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict:
        trainer = self._trainer
        if trainer is None:
            return {}
        # Every rank writes a checkpoint's contents (rank zero alone saves them), so this
        # all-gather runs on every rank at the same point.
        with allow_syncs("CheckpointRngState: generator states travel with each save"):
            mine = capture_rng_state().to(trainer.strategy.root_device)
            states = trainer.strategy.all_gather(mine) if trainer.world_size > 1 else mine[None]
            return {"per_rank": states.cpu()}

    def load_state_dict(self, state_dict: dict) -> None:
        states = state_dict.get("per_rank")
        trainer = self._trainer
        if states is None or trainer is None:
            return
        if len(states) != trainer.world_size:
            log.warning(
                "random generator states not restored: the checkpoint was written by %d "
                "process(es), this run has %d; augmentations from here on differ from an "
                "uninterrupted run", len(states), trainer.world_size,
            )  # fmt: skip
            return
        self._to_restore = states[trainer.global_rank]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # As late as possible: nothing between here and the first batch draws random
        # numbers, just as nothing did after the checkpoint was written.
        if self._to_restore is not None:
            restore_rng_state(self._to_restore)
            self._to_restore = None
