"""The benchmarks' own model and data, so that ``make bench`` measures the package whatever
``template/`` holds (even nothing).

A CIFAR-style ResNet-18 (``width`` channels in the first stage: 64 is the standard one)
over random class-coded 32x32 images held in memory, in two ways:

- ``Images()``: uint8 host batches (pinned on a GPU), augmented and normalised on the
  device after the copy; ``Classifier`` keeps its loss on the device and logs it at
  logging steps only: the way this template trains.
- ``Images(host_augment=True)``: per-image crop, flip and normalisation to float32 in the
  DataLoader workers (torchvision), pageable memory; ``PlainClassifier`` reads the loss
  with ``.item()`` every step and logs with ``prog_bar=True``: the way a first version does.

Example::

    trainer.fit(Classifier(width=16), Images(batch_size=32, train_size=32 * 60))
"""

from __future__ import annotations

import os
import random

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from gpu_busy.lightning_compat import is_logging_step

CLASSES = 10
MEAN, STD = 0.5, 0.25  # of the images below, scaled to [0, 1]


def class_coded_images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [n, 3, 32, 32] noise with a brighter channel and row band per class, and the
    int64 labels: learnable, so a loss that falls says the step is a real one."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    images = torch.randint(0, 160, (n, 3, 32, 32), generator=g, dtype=torch.uint8)
    rows = torch.arange(32).view(1, 32, 1)
    band = (rows // 3 == labels.view(n, 1, 1)).to(torch.uint8) * 90
    images[torch.arange(n), labels % 3] += band.expand(n, 32, 32)
    return images, labels


def loader_workers() -> int:
    """The cores this process may use, less one for it (at most 8)."""
    try:
        cores = len(os.sched_getaffinity(0))  # what a container or taskset allows
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return max(0, min(8, cores - 1))


class _Pairs(Dataset):
    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform=None) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        image = self.images[i]
        return (self.transform(image) if self.transform else image), self.labels[i]


class Images(pl.LightningDataModule):
    def __init__(
        self,
        batch_size: int = 32,
        train_size: int = 2048,
        val_size: int = 256,
        num_workers: int = 0,
        pin_memory: bool = False,
        host_augment: bool = False,
    ) -> None:
        super().__init__()
        self.batch_size, self.num_workers = batch_size, num_workers
        self.pin_memory, self.host_augment = pin_memory, host_augment
        self.train_set = _Pairs(*class_coded_images(train_size, seed=0), self._transform())
        self.val_set = _Pairs(*class_coded_images(val_size, seed=1))
        self._shift = random.Random(0)  # host-side draws: no tensor to read back

    def _transform(self):
        if not self.host_augment:
            return None
        from torchvision.transforms import v2

        return v2.Compose(
            [
                v2.RandomCrop(32, padding=4),
                v2.RandomHorizontalFlip(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize([MEAN] * 3, [STD] * 3),
            ]
        )

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=train,
            drop_last=train,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=self.pin_memory,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        images, labels = batch
        if images.dtype != torch.uint8:
            return batch  # augmented and normalised on the host already
        x = images.float().div_(255)
        if self.trainer is not None and self.trainer.training:
            # one random shift per batch and a per-image flip, all on the device
            i, j = self._shift.randrange(9), self._shift.randrange(9)
            x = F.pad(x, (4, 4, 4, 4))[..., i : i + 32, j : j + 32]
            flip = torch.rand(x.shape[0], 1, 1, 1, device=x.device) < 0.5
            x = torch.where(flip, x.flip(3), x)
        return (x - MEAN) / STD, labels


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.skip = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.skip(x))


def resnet18(width: int) -> nn.Sequential:
    """ResNet-18 for 32x32 inputs: a 3x3 stem, four stages of two blocks."""
    widths = [width, 2 * width, 4 * width, 8 * width]
    layers: list[nn.Module] = [
        nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
    ]  # fmt: skip
    cin = width
    for stage, cout in enumerate(widths):
        layers += [_Block(cin, cout, 1 if stage == 0 else 2), _Block(cout, cout, 1)]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, CLASSES))


class Classifier(pl.LightningModule):
    """Reads nothing back in a step: the loss sums on the device, logged at logging steps."""

    def __init__(self, width: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = resnet18(width)
        self.register_buffer("_loss_sum", torch.zeros(()), persistent=False)
        self._losses = 0

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self._loss_sum += loss.detach()
        self._losses += 1
        if is_logging_step(self.trainer):
            self.log("train/loss", self._loss_sum / self._losses)
            self._loss_sum.zero_()
            self._losses = 0
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        images, labels = batch
        accuracy = (self(images).argmax(1) == labels).float().mean()
        self.log("val/acc", accuracy, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class PlainClassifier(Classifier):
    """The step most first versions have: a per-step .item() and prog-bar logging."""

    running_loss = 0.0

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.running_loss = 0.98 * self.running_loss + 0.02 * loss.item()
        self.log("train/loss", loss, prog_bar=True)
        return loss
