"""Runs made to be bound one way each, for the verdict's tests: a slow DataLoader, an
``.item()`` per step, a tiny model, one slow rank. Built on the foreign-style modules
(Adam, torchmetrics, ``prog_bar=True``, dict batches), not on the template's."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, default_collate

from template.models import ImageClassifier
from tests.helpers.foreign_modules import BlobClassifier, BlobData


class SlowBlobData(BlobData):
    """Every batch takes ``delay_ms`` more to load (a slow disk, heavy decoding)."""

    def __init__(self, delay_ms: float = 0.0, features: int = 16, batch_size: int = 32) -> None:
        super().__init__(features=features, batch_size=batch_size)
        self.delay_ms = delay_ms

    def _collate(self, items):
        time.sleep(self.delay_ms / 1e3)
        return default_collate(items)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, collate_fn=self._collate
        )


class WideBlobClassifier(BlobClassifier):
    """Enough arithmetic per step that the loop's own cost is small beside it; optionally
    reads the loss back every step (``item_every_step``), as a progress print would."""

    def __init__(
        self,
        num_classes: int = 5,
        features: int = 16,
        width: int = 1024,
        item_every_step: bool = False,
        lr: float = 1e-3,
    ) -> None:
        super().__init__(num_classes=num_classes, features=features, lr=lr)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(features, width), torch.nn.ReLU(),
            torch.nn.Linear(width, width), torch.nn.ReLU(),
            torch.nn.Linear(width, num_classes),
        )  # fmt: skip
        self.item_every_step = item_every_step
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        logits = self.net(batch["x"])
        loss = F.cross_entropy(logits, batch["y"])
        if self.item_every_step:
            self.losses.append(loss.item())
        return loss


class SlowRankClassifier(BlobClassifier):
    """Rank ``slow_rank`` takes ``delay_ms`` longer over each training step (a slower
    machine): the other ranks wait for its gradients."""

    def __init__(
        self, num_classes: int = 5, slow_rank: int = 1, delay_ms: float = 40.0, lr: float = 1e-2
    ) -> None:
        super().__init__(num_classes=num_classes, lr=lr)
        self.slow_rank, self.delay_ms = slow_rank, delay_ms

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == self.slow_rank:
            time.sleep(self.delay_ms / 1e3)
        return loss


class SyncFreeBlobClassifier(BlobClassifier):
    """``BlobClassifier`` with its two per-step reads fixed: no ``prog_bar=True`` (Lightning
    turns progress-bar values into Python numbers every step), and the accuracy computed on
    the device (torchmetrics' per-step update sizes a ``bincount`` on the host)."""

    def training_step(self, batch, batch_idx):
        logits = self.net(batch["x"])
        loss = F.cross_entropy(logits, batch["y"])
        accuracy = (logits.argmax(dim=1) == batch["y"]).float().mean()
        self.log_dict({"train/loss": loss, "train/acc": accuracy})
        return loss


class ProgBarImageClassifier(ImageClassifier):
    """The template's model written the common way: per-step values logged with
    ``prog_bar=True`` and the accuracy called per step (a sync per value per step under
    Lightning's own bar; none under the template's)."""

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.hparams.label_smoothing)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_acc(logits, labels), prog_bar=True)
        return loss


class ItemImageClassifier(ImageClassifier):
    """The template's model with the commonest sync written the common way: each step's
    loss and accuracy read with ``.item()`` to log them (the "before" of a sync fix; the
    ``prog_bar=True`` beside them costs nothing under the template's bar)."""

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.hparams.label_smoothing)
        accuracy = (logits.argmax(dim=1) == labels).float().mean()
        self.log("train/loss", loss.item(), prog_bar=True)
        self.log("train/acc", accuracy.item(), prog_bar=True)
        return loss
