"""A model and data whose run ends the way they are told, for both doors: the entry point
(``--model.class_path=tests.helpers.doors.EndingModel``) and the launcher
(``tests/launcher/scripts/ending_script.py``).

``ending``: ``success``; ``strict`` (an ``.item()`` every step, for ``--strict``);
``exit3`` (``sys.exit(3)`` in a step); ``crash`` (the user's ``ValueError``); ``sigterm``
(SIGTERM to itself after step 2); ``save_fails`` (the checkpoint folder turned into a file
after step 2, so the epoch's save fails); ``sigterm_in_validation`` (SIGTERM at the first
validation batch, each one taking 0.5 s); ``loader_hangs`` (SIGTERM, then a batch that
never comes). A signal's time goes to ``$ENDING_SIGNAL_AT``, for the bound.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from gpu_busy.resumable_data import ResumableData

ENDINGS = ("success", "strict", "exit3", "crash", "sigterm", "save_fails",
           "sigterm_in_validation", "loader_hangs")  # fmt: skip


def _signal_self() -> None:
    if at := os.environ.get("ENDING_SIGNAL_AT"):
        Path(at).write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGTERM)


class Points(Dataset):
    """Fixed points; with ``hang_at``, reading that item signals the process and blocks."""

    def __init__(self, size: int, seed: int, hang_at: int | None = None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 8, generator=g)
        self.y = (self.x.sum(1) > 0).long()
        self.hang_at = hang_at

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        if i == self.hang_at:
            _signal_self()
            while True:  # a loader that never yields (a stuck file system, a dead server)
                time.sleep(3600)
        return self.x[i], self.y[i]


class EndingData(ResumableData, pl.LightningDataModule):
    """``plain_loader``: a shuffled ``DataLoader`` as scripts write it, with no position of
    its own (a resume reads past the batches trained); else a ``ResumableSampler``."""

    def __init__(self, ending: str = "success", batch_size: int = 4, val_batches: int = 2,
                 plain_loader: bool = False):  # fmt: skip
        super().__init__()
        self.ending, self.batch_size, self.val_batches = ending, batch_size, val_batches
        self.plain_loader = plain_loader

    def train_dataloader(self):
        hang_at = 3 * self.batch_size if self.ending == "loader_hangs" else None
        data = Points(16 * self.batch_size, seed=0, hang_at=hang_at)
        if self.plain_loader:
            return DataLoader(data, batch_size=self.batch_size, shuffle=True, drop_last=True)
        sampler = self.resumable_sampler(data, batch_size=self.batch_size, shuffle=False)
        return DataLoader(data, batch_size=self.batch_size, sampler=sampler, drop_last=True)

    def val_dataloader(self):
        return DataLoader(Points(self.val_batches * self.batch_size, seed=1), self.batch_size)


class EndingModel(pl.LightningModule):
    def __init__(self, ending: str = "success") -> None:
        super().__init__()
        if ending not in ENDINGS:
            raise ValueError(f"ending={ending!r}: one of {ENDINGS}")
        self.ending = ending
        self.layer = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.layer(x), y)
        if self.ending == "strict":
            self.log("loss_value", loss.item())  # a sync in every steady step
        if self.ending == "exit3" and self.global_step == 2:
            sys.exit(3)
        if self.ending == "crash" and self.global_step == 2:
            raise ValueError("the user's own error at step 2")
        self.log("train/loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.global_step != 2:
            return
        if self.ending == "sigterm":
            _signal_self()
        if self.ending == "save_fails":
            for callback in self.trainer.checkpoint_callbacks:
                if callback.dirpath:  # a folder that became a file: every save there fails
                    shutil.rmtree(callback.dirpath, ignore_errors=True)
                    Path(callback.dirpath).write_text("not a folder")

    def validation_step(self, batch, batch_idx):
        x, y = batch
        if self.ending == "sigterm_in_validation" and not self.trainer.sanity_checking:
            if batch_idx == 0:
                _signal_self()
            time.sleep(0.5)
        self.log("val/loss", F.cross_entropy(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
