"""Exact resumes for your own DataModule: mix ``ResumableData`` in, draw the training
order from ``resumable_sampler``, and a run resumed from a mid-epoch checkpoint trains the
batches the stopped run had not, in the same order, as if it had never stopped.

Example::

    class MyData(ResumableData, pl.LightningDataModule):
        def train_dataloader(self):
            sampler = self.resumable_sampler(self.train_set, batch_size=64)
            return DataLoader(self.train_set, batch_size=64, sampler=sampler, drop_last=True)

The checkpoint carries where training stood (epoch, batches of it trained, batch size);
resuming with another batch size mid-epoch is refused with the flag to pass. The order is
fixed by (seed, epoch), the seed being ``seed_everything``'s (``PL_GLOBAL_SEED``), the
same on every rank; under DDP each rank gets its shard.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from torch.utils.data import Dataset

from gpu_busy import lightning_compat as compat
from gpu_busy.errors import UserError
from gpu_busy.resume.sampler import ResumableSampler


def shuffle_seed() -> int:
    """The seed of the training order: ``seed_everything``'s, the same on every rank.

    Lightning's own distributed sampler takes it from the same place (0 when unseeded).
    """
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


class ResumableData:
    """A mixin for a ``LightningDataModule`` (put it first among the bases): its
    ``state_dict`` / ``load_state_dict`` save and restore the position in the epoch, and
    ``resumable_sampler`` starts there."""

    trainer: Any  # LightningDataModule's
    _resume_at: tuple[int, int] | None = None  # (epoch, batches) from a checkpoint
    _resume_batch_size: int | None = None

    def resumable_sampler(
        self, dataset: Dataset, batch_size: int, shuffle: bool = True
    ) -> ResumableSampler:
        """The training sampler: this rank's shard, each epoch's order from (seed, epoch),
        started where a resumed checkpoint stopped. Give the DataLoader the same
        ``batch_size`` and ``drop_last=True``."""
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer else (1, 0)
        sampler = ResumableSampler(
            dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=shuffle_seed()
        )
        self._resume_batch_size = batch_size
        # Lightning may start this loader before it restores the epoch counter and calls
        # set_epoch (when the LR schedule asks for the number of steps), so the epoch a
        # checkpoint resumes in is set here.
        if self._resume_at is not None:
            epoch, batches = self._resume_at
            self._check_batch_size(batches, batch_size)
            sampler.set_epoch(epoch)
            sampler.resume_at(epoch, batches, batch_size)
        return sampler

    def state_dict(self) -> dict:
        # Where training stands, so a resumed run starts the right epoch at the right batch.
        if self.trainer is None:
            return {}
        epoch, batches = compat.epoch_position(self.trainer)
        return {"epoch": epoch, "batches_trained": batches, "batch_size": self._batch_size()}

    def load_state_dict(self, state: dict) -> None:
        if "epoch" not in state:
            return
        self._resume_at = (int(state["epoch"]), int(state["batches_trained"]))
        self._saved_batch_size = state.get("batch_size")
        self._check_batch_size(self._resume_at[1], self._batch_size())
        # Lightning warns that a mid-epoch resume is unreliable unless the DataLoader itself
        # is stateful; here the sampler resumes, so the warning does not apply.
        warnings.filterwarnings(
            "ignore", message="You're resuming from a checkpoint that ended before"
        )

    def _batch_size(self) -> int | None:
        return self._resume_batch_size or getattr(self, "batch_size", None)

    def _check_batch_size(self, batches: int, batch_size: int | None) -> None:
        saved = getattr(self, "_saved_batch_size", None)
        if batches and batch_size is not None and saved not in (None, batch_size):
            # Mid-epoch, the position is a count of batches: with another size it would
            # point at other samples, some trained twice and others skipped.
            raise UserError(
                f"the checkpoint stopped {batches} batches into an epoch with "
                f"data.batch_size={saved}, and this run has {batch_size}: resume with "
                f"--data.batch_size={saved}, or from a checkpoint saved at an epoch's end"
            )
