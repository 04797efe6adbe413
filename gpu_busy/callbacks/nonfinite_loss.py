"""StopOnNonFiniteLoss: stop at the first NaN or Inf loss, without a per-step sync.

The losses are checked on the device (``gpu_busy.faults.nonfinite``); a logging step sends
the flag, over ranks, to the host without waiting, and the next one reads it. Where the
loop waits anyway (before validation, at an epoch's end and any save) it is read at once,
so no checkpoint is written from non-finite weights. Details: docs/ARCHITECTURE.md,
"Resuming".

Example::

    trainer = Trainer(callbacks=[StopOnNonFiniteLoss()])
    # error: the loss was NaN or Inf at step 1234 (rank 1); stopped before saving; the
    #        last good checkpoint is runs/default/version_3/checkpoints/last.ckpt
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch

from gpu_busy import lightning_compat as compat
from gpu_busy.faults.nonfinite import FirstNonFinite
from gpu_busy.faults.training_stopped import TrainingStopped
from gpu_busy.host_reads import LateRead
from gpu_busy.syncs import allow_syncs


class StopOnNonFiniteLoss(compat.Callback):
    """Raise ``TrainingStopped`` at the first check after a NaN or Inf training loss."""

    def __init__(self) -> None:
        self.watch = FirstNonFinite()
        self._late = LateRead()  # the flag over ranks, on its way to the host
        self._start_step = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.watch, self._late = FirstNonFinite(), LateRead()
        self._start_step = trainer.global_step

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        self.watch.update(loss)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if compat.is_logging_step(trainer):
            self._stop_if_bad(trainer, self._late.take())  # what the last logging step sent
            first = self.watch.first_tensor()
            if first is not None:
                self._late.put(self._over_ranks(trainer, first))

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit":
            self._check(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._check(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # Any other save (StopOnSignal's, a user's mid-epoch one) is checked too; raising
        # here aborts the save before the file is touched.
        if trainer.state.fn == "fit":
            self._check(trainer)

    def _check(self, trainer: pl.Trainer) -> None:
        self._late.take()  # the flag read now is newer
        first = self.watch.first_tensor()
        if first is None:
            return
        with allow_syncs("StopOnNonFiniteLoss reads its NaN/Inf flag where the loop waits anyway"):
            rows = self._over_ranks(trainer, first).tolist()
        self._stop_if_bad(trainer, rows)

    @staticmethod
    def _over_ranks(trainer: pl.Trainer, first: torch.Tensor) -> torch.Tensor:
        # every rank asks: every rank stops at the same check
        return (
            trainer.strategy.all_gather(first).reshape(-1)
            if trainer.world_size > 1
            else first[None]
        )

    def _stop_if_bad(self, trainer: pl.Trainer, rows: list[int] | None) -> None:
        bad = [(index, rank) for rank, index in enumerate(rows or []) if index >= 0]
        if not bad:
            return
        index, rank = min(bad)
        step = self._start_step + index // trainer.accumulate_grad_batches  # index: backwards
        last = _newest_checkpoint(trainer)
        where = f"the last good checkpoint is {last}" if last else "no checkpoint was saved"
        on_rank = f" (rank {rank})" if trainer.world_size > 1 else ""
        raise TrainingStopped(
            f"the loss was NaN or Inf at step {step}{on_rank}; stopped "
            f"before saving; {where}. Lower the learning rate or check the data at that step"
        )


def _newest_checkpoint(trainer: pl.Trainer) -> str | None:
    """The most recently written checkpoint of any ModelCheckpoint callback."""
    paths = {
        path
        for cb in trainer.checkpoint_callbacks
        for path in (getattr(cb, "last_model_path", ""), getattr(cb, "best_model_path", ""))
        if path and Path(path).is_file()
    }
    return max(paths, key=lambda p: Path(p).stat().st_mtime, default=None)
