"""A LightningModule and a DataModule in the style people write, not the template's.

Adam, a torchmetrics metric called as a function, ``prog_bar=True``, dict batches from a
plain Dataset: trained through ``--model.class_path`` / ``--data.class_path`` to show
that the entry point and every callback take code this project did not write.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import LightningTransformer
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchmetrics.classification import MulticlassAccuracy


class Blobs(Dataset):
    """Points around ``num_classes`` centres, as dicts."""

    def __init__(self, size: int, num_classes: int, features: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        centres = torch.randn(num_classes, features, generator=torch.Generator().manual_seed(0))
        self.y = torch.randint(0, num_classes, (size,), generator=g)
        self.x = 3 * centres[self.y] + torch.randn(size, features, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class BlobData(pl.LightningDataModule):
    def __init__(
        self, num_classes: int = 5, features: int = 16, batch_size: int = 32, num_workers: int = 0
    ) -> None:
        super().__init__()
        self.num_classes, self.features, self.batch_size = num_classes, features, batch_size
        self.num_workers = num_workers  # plain workers: they die with a group signal

    def setup(self, stage: str) -> None:
        self.train_set = Blobs(512, self.num_classes, self.features, seed=1)
        self.val_set = Blobs(128, self.num_classes, self.features, seed=2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True,
            num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
        )  # fmt: skip

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)


class BlobClassifier(pl.LightningModule):
    def __init__(self, num_classes: int = 2, features: int = 16, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(features, 32), torch.nn.ReLU(), torch.nn.Linear(32, num_classes)
        )
        self.train_acc = MulticlassAccuracy(num_classes)
        self.val_acc = MulticlassAccuracy(num_classes)

    def training_step(self, batch, batch_idx):
        logits = self.net(batch["x"])
        loss = F.cross_entropy(logits, batch["y"])
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_acc(logits, batch["y"]), prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.val_acc(self.net(batch["x"]), batch["y"])
        self.log("val/acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class FixedHeadClassifier(BlobClassifier):
    """Takes no ``num_classes``: the CLI's link from the DataModule must leave it alone."""

    def __init__(self, outputs: int = 5, lr: float = 1e-2) -> None:
        super().__init__(num_classes=outputs, lr=lr)


def tokens(seed: int, sequences: int = 64, length: int = 16, batch_size: int = 8) -> DataLoader:
    """Random token sequences and the same shifted by one: the demo Transformer's pairs."""
    x = torch.randint(0, 100, (sequences, length), generator=torch.Generator().manual_seed(seed))
    return DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=batch_size)


class SyntheticTransformer(LightningTransformer):
    """Lightning's Transformer demo on synthetic tokens (its own data is downloaded)."""

    def __init__(self) -> None:
        super().__init__(vocab_size=100)

    def prepare_data(self) -> None:
        pass

    def train_dataloader(self) -> DataLoader:
        return tokens(0)


class NeedsLr(BlobClassifier):
    """A learning rate with no default: the example's must not stand in for it."""

    def __init__(self, lr: float, num_classes: int = 2) -> None:
        super().__init__(num_classes=num_classes, lr=lr)


class ImageMLP(pl.LightningModule):
    """A newcomer's first model for the example's images: Adam at its usual 1e-3."""

    def __init__(self, num_classes: int = 10, hidden: int = 128, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.LazyLinear(hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, num_classes),
        )

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self.net(images), labels)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        self.log("val/acc", (self.net(images).argmax(1) == labels).float().mean())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class _Checkpoint(torch.autograd.Function):
    """Gradient checkpointing as openai's diffusion UNets write it: the forward runs the
    block under ``no_grad`` (a view of an input that requires grad, with no ``grad_fn``,
    reaches the block's modules), the backward runs it again with grad on."""

    @staticmethod
    def forward(ctx, run, length, *args):
        ctx.run, ctx.inputs, ctx.params = run, list(args[:length]), list(args[length:])
        with torch.no_grad():
            return run(*ctx.inputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(True) for x in ctx.inputs]
        with torch.enable_grad():
            out = ctx.run(*[x.view_as(x) for x in inputs])
        got = torch.autograd.grad(out, inputs + ctx.params, grads, allow_unused=True)
        return (None, None, *got)


class CheckpointedBlocks(pl.LightningModule):
    """A regression net whose blocks are checkpointed through ``_Checkpoint``."""

    def __init__(self, features: int = 16, blocks: int = 2) -> None:
        super().__init__()
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(features) for _ in range(blocks))
        self.projs = torch.nn.ModuleList(torch.nn.Linear(features, features) for _ in range(blocks))

    def _block(self, i: int):
        def run(x: torch.Tensor) -> torch.Tensor:
            flat = x.reshape(x.shape[0], -1)  # the view the blocks see under no_grad
            return self.projs[i](self.norms[i](flat)).reshape(x.shape)

        return run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.projs)):
            params = [*self.norms[i].parameters(), *self.projs[i].parameters()]
            x = x + _Checkpoint.apply(self._block(i), 1, x, *params)
        return x

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return F.mse_loss(self(x * 2), x)  # x * 2: the blocks' input has a grad_fn upstream

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 16, generator=g)), batch_size=8)
