"""A Lightning script as users write them, run by the launcher's tests as it is: a plain
Trainer, ``acc.item()`` logged with ``prog_bar=True`` (line 36: the sync the report names).
``USER_TRAIN_LIGHTNING=pytorch_lightning`` takes ``pl`` from that package, and the callbacks
still from ``lightning.pytorch``: a script that mixes both names.

    python user_train.py [--strategy ddp --devices 2] [--own-bar] [--raise] [--exit N]
"""

import argparse
import importlib
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from torch.utils.data import DataLoader, TensorDataset

pl = importlib.import_module(os.environ.get("USER_TRAIN_LIGHTNING", "lightning.pytorch"))


class Net(pl.LightningModule):
    def __init__(self, record: str | None = None):
        super().__init__()
        self.layer = torch.nn.Linear(32, 4)
        self.record = record

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.layer(x)
        loss = F.cross_entropy(logits, y)
        if batch_idx == 2 and os.environ.get("USER_TRAIN_RAISE"):
            raise ValueError("the user's own error at step 2")
        self.log("loss", loss, prog_bar=True)
        self.log("acc", (logits.argmax(1) == y).float().mean().item(), prog_bar=True)
        return loss

    def on_train_end(self):
        if self.record:  # which callbacks this rank trained with
            names = sorted(type(c).__name__ for c in self.trainer.callbacks)
            path = Path(self.record) / f"callbacks.rank{self.trainer.global_rank}.txt"
            path.write_text(" ".join(names))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--own-bar", action="store_true")
    parser.add_argument("--record")
    parser.add_argument("--exit", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 32), torch.randint(0, 4, (512,)))
    own = (
        [TQDMProgressBar(refresh_rate=5), ModelCheckpoint(filename="mine")] if args.own_bar else []
    )
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        log_every_n_steps=4,
        callbacks=own,
        enable_model_summary=False,
    )
    trainer.fit(Net(args.record), DataLoader(data, batch_size=16))
    logged = {k: round(float(v), 6) for k, v in sorted(trainer.callback_metrics.items())}
    print(f"user script done at step {trainer.global_step}: {logged}")
    return args.exit


if __name__ == "__main__":
    sys.exit(main())
