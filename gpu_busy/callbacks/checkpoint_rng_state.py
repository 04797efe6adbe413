"""CheckpointRngState: checkpoints carry every rank's random generator states.

Lightning restores weights, optimizer, schedulers and loop counters, not the random
generators. This callback gathers every rank's into the checkpoint and puts each back on
its rank right before the resumed run's first batch (after the sanity check). With a
``ResumableSampler`` this makes a resumed run end with the weights of one that never
stopped. A training loader that keeps no position of its own (a plain ``DataLoader``) is
iterated again from the generator states its epoch began with, and the batches trained
before the stop are read and passed over: the order of the stopped run wherever it follows
from those states (a shuffled or seeded sampler, workers' seeds), at the cost of reading
them. Details: docs/ARCHITECTURE.md, "Exact resume".

Example::

    trainer = Trainer(callbacks=[CheckpointRngState()])
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from gpu_busy import batch_routing
from gpu_busy import lightning_compat as compat
from gpu_busy.log import get_logger
from gpu_busy.resume.rng_state import capture_rng_state, restore_rng_state
from gpu_busy.resume.sampler import ResumableSampler
from gpu_busy.syncs import allow_syncs

log = get_logger(__name__)


class CheckpointRngState(compat.Callback):
    """Save each rank's generator states with every checkpoint; restore them on resume."""

    def __init__(self) -> None:
        self._trainer: pl.Trainer | None = None
        self._to_restore: torch.Tensor | None = None
        self._epoch_start: torch.Tensor | None = None  # states the epoch's order came from
        self._resume_at: tuple[int, int] | None = None  # (epoch, batches trained)
        self._epoch_start_to_restore: torch.Tensor | None = None
        self._layer = batch_routing.Layer("read-past", position=-3)  # next to the DataLoader

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict:
        trainer = self._trainer
        if trainer is None:
            return {}
        now, start = capture_rng_state(), self._epoch_start
        start = start if start is not None and start.shape == now.shape else now
        # Every rank writes a checkpoint's contents (rank zero alone saves them), so this
        # all-gather runs on every rank at the same point: now and at the epoch's start.
        with allow_syncs("CheckpointRngState: generator states travel with each save"):
            mine = torch.stack([now, start]).to(trainer.strategy.root_device)
            states = trainer.strategy.all_gather(mine) if trainer.world_size > 1 else mine[None]
            states = states.cpu()
        return {
            "per_rank": states[:, 0],
            "per_rank_epoch_start": states[:, 1],
            "position": list(compat.epoch_position(trainer)),
        }

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
        starts, position = state_dict.get("per_rank_epoch_start"), state_dict.get("position")
        if starts is not None and position is not None:
            self._epoch_start_to_restore = starts[trainer.global_rank]
            self._resume_at = (int(position[0]), int(position[1]))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # As late as possible: nothing between here and the first batch draws random
        # numbers, just as nothing did after the checkpoint was written.
        at, self._resume_at = self._resume_at, None
        if at is not None and at[1] and not _keeps_its_position(trainer.train_dataloader):
            self._read_past(trainer, *at)
        elif self._to_restore is not None:
            restore_rng_state(self._to_restore)
            self._to_restore = None

    def _read_past(self, trainer: pl.Trainer, epoch: int, batches: int) -> None:
        log.info(
            "resuming %d batches into epoch %d: the training loader keeps no position of "
            "its own, so it starts again from the generator states the epoch began with and "
            "the %d batches trained are read and passed over",
            batches, epoch, batches,
        )  # fmt: skip
        restore_rng_state(self._epoch_start_to_restore)
        left = [batches]

        def read_past(items):
            count, left[0] = left[0], 0  # the resumed epoch's first iteration only
            return batch_routing.ReadPast(items, count, self._restore_saved)

        self._layer.route(trainer.fit_loop, read_past)

    def _restore_saved(self) -> None:
        if self._to_restore is not None:
            restore_rng_state(self._to_restore)
            self._to_restore = None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # before the loader is iterated: the states its order and workers' seeds come from
        self._epoch_start = capture_rng_state()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._layer.remove()


def _keeps_its_position(loaders: object) -> bool:
    """Whether every training loader resumes mid-epoch by itself: a ``ResumableSampler``
    starts where the checkpoint stopped, and Lightning restores a stateful loader's
    ``state_dict`` (``loops/fit_loop.py``, ``_Stateful``)."""
    if isinstance(loaders, dict):
        return all(_keeps_its_position(v) for v in loaders.values())
    if isinstance(loaders, list | tuple):
        return all(_keeps_its_position(v) for v in loaders)
    samplers = (getattr(loaders, "sampler", None),
                getattr(getattr(loaders, "batch_sampler", None), "sampler", None))  # fmt: skip
    stateful = callable(getattr(loaders, "state_dict", None)) and callable(
        getattr(loaders, "load_state_dict", None)
    )
    return stateful or any(isinstance(s, ResumableSampler) for s in samplers)
