"""A user's own text classifier in a folder of its own, as people write one: AdamW with a
warm-up schedule, a torchmetrics ``MetricCollection`` with torchmetrics' defaults,
``prog_bar=True``, and six accidental syncs. ``fixed`` names the fixes applied, each as
the sync report prints it (tests/whole/test_fixes_walked.py walks them).

Found as ``mytext`` with its folder on ``PYTHONPATH``, as README says for a package of
your own (``--model.class_path mytext.TextClassifier``).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

PAD, VOCAB, LENGTH, CLASSES = 0, 50, 12, 4


class TextClassifier(pl.LightningModule):
    def __init__(self, fixed: tuple[str, ...] = (), width: int = 16) -> None:
        super().__init__()
        self.fixed = frozenset(fixed)
        self.embed = torch.nn.Embedding(VOCAB, width, padding_idx=PAD)
        self.head = torch.nn.Linear(width, CLASSES)
        self.seen = torch.nn.Buffer(torch.zeros(CLASSES, dtype=torch.long))
        if "metrics" in self.fixed:
            self.train_metrics = MetricCollection(
                {
                    "acc": MulticlassAccuracy(CLASSES, average="micro", validate_args=False),
                    "f1": MulticlassF1Score(CLASSES, average="micro", validate_args=False),
                },
                compute_groups=False,
            )
        else:
            self.train_metrics = MetricCollection(
                {"acc": MulticlassAccuracy(CLASSES), "f1": MulticlassF1Score(CLASSES)}
            )
        self.running = []

    def pooled(self, tokens: torch.Tensor) -> torch.Tensor:
        emb, mask = self.embed(tokens), tokens != PAD
        if "mask" in self.fixed:
            summed = torch.where(mask[..., None], emb, 0).sum(1)
            return summed / mask.sum(1, keepdim=True).clamp_min(1)
        return torch.stack([e[m].mean(0) for e, m in zip(emb, mask, strict=True)])

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        logits = self.head(self.pooled(tokens))
        loss = F.cross_entropy(logits, labels)
        if "branch" in self.fixed:
            loss = torch.where(torch.isnan(loss), torch.zeros_like(loss), loss)
        elif torch.isnan(loss):
            loss = torch.zeros_like(loss)
        if "log" in self.fixed:
            self.log("train/loss", loss, prog_bar=True)
        else:
            self.running.append(loss.item())
            print(f"\rloss {loss:.3f}", end="")
            if batch_idx == 0:
                print("first logits:", logits[0])
        if "counts" in self.fixed:
            self.seen += torch.zeros(CLASSES, dtype=torch.long, device=labels.device).scatter_add_(
                0, labels, torch.ones_like(labels)
            )
        else:
            self.seen += torch.bincount(labels.cpu(), minlength=CLASSES).to(self.device)
        self.train_metrics.update(logits.argmax(1), labels)
        self.log_dict(self.train_metrics, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class TextData(pl.LightningDataModule):
    def __init__(self, batch_size: int = 8, size: int = 96) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(3, LENGTH + 1, (size,), generator=g)
        tokens = torch.randint(1, VOCAB, (size, LENGTH), generator=g)
        tokens[torch.arange(LENGTH)[None, :] >= lengths[:, None]] = PAD
        self.data = TensorDataset(tokens, tokens[:, 0] % CLASSES)
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)
