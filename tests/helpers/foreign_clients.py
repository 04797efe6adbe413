"""Lightning programs written the way tutorials and public repositories write them (none
copied from anywhere), each holding one idiom the sync simulation and the callbacks must
get right. Trained directly and through ``--model.class_path`` by
tests/whole/test_foreign_clients.py; each class says what a GPU run does, the truth its test
checks the report against.
"""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torchmetrics.classification import MulticlassAccuracy


def pairs(n: int = 96, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


class LogsEveryStep(pl.LightningModule):
    """Adam, ``self.log`` of a tensor every step, a torchmetrics metric logged in
    validation only. GPU truth: no sync in a training step (Lightning reduces logged
    tensors on the device; torchmetrics' resets copy device to device)."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
        )
        self.val_acc = MulticlassAccuracy(2)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_acc(self.net(x), y)
        self.log("val/acc", self.val_acc)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(pairs(), batch_size=12)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(pairs(24, seed=1), batch_size=12)


class NoiseByTypeAs(pl.LightningModule):
    """A GAN in manual optimization: noise and targets made on the host and moved with
    ``type_as``. GPU truth: four blocking host-to-device copies per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = torch.nn.Linear(4, 12)
        self.critic = torch.nn.Linear(12, 1)

    def training_step(self, batch, batch_idx):
        real, _ = batch
        gen_opt, critic_opt = self.optimizers()
        z = torch.randn(real.size(0), 4).type_as(real)
        fake = self.generator(z)
        ones = torch.ones(real.size(0), 1).type_as(real)
        gen_loss = F.binary_cross_entropy_with_logits(self.critic(fake), ones)
        gen_opt.zero_grad()
        self.manual_backward(gen_loss)
        gen_opt.step()
        real_target = torch.ones(real.size(0), 1).type_as(real)
        fake_target = torch.zeros(real.size(0), 1).type_as(real)
        critic_loss = F.binary_cross_entropy_with_logits(
            self.critic(real), real_target
        ) + F.binary_cross_entropy_with_logits(self.critic(fake.detach()), fake_target)
        critic_opt.zero_grad()
        self.manual_backward(critic_loss)
        critic_opt.step()

    def configure_optimizers(self):
        return [
            torch.optim.Adam(self.generator.parameters()),
            torch.optim.Adam(self.critic.parameters()),
        ]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(pairs(), batch_size=12)


class UnusedBranch(LogsEveryStep):
    """A head that only some runs use: DDP needs ``find_unused_parameters=True``. GPU
    truth: DDP's reducer copies its used-parameter map to the host once per backward."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__(lr=lr)
        self.aux_head = torch.nn.Linear(16, 3)  # never used in this run


class NumpyCosine(LogsEveryStep):
    """A cosine schedule computed with NumPy: the optimizer's and scheduler's state hold
    ``numpy.float64`` learning rates, which a checkpoint must save so that it loads."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        total = 40

        def factor(step: int) -> float:
            return 0.5 * (1.0 + np.cos(np.pi * min(step, total) / total))  # numpy.float64

        return [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, factor)]


class Stream(IterableDataset):
    """Batches from a generator, with no length."""

    def __init__(self, batches: int = 6) -> None:
        self.batches = batches

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(self.batches):
            x = torch.randn(12, 12, generator=g)
            yield x, (x[:, 0] > 0).long()


class FromAStream(LogsEveryStep):
    """An ``IterableDataset`` without a length. Truth: every batch reaches the step through
    the prefetcher (Lightning reads the first one ahead, before any callback hook)."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Stream(), batch_size=None)

    def val_dataloader(self):
        return []
