"""The template's throughput beside Lightning's ThroughputMonitor, and FLOPs beside hand counts.

    python -m bench.throughput [--repeats 3]

One fit per repeat with both monitors (and ``SyncPointDetector(strict=True)`` watching
every step): the template's samples/s over batches 1..N-1 (``warmup_steps=1``) and
Lightning's over the same window. Then ``FlopCount`` (PyTorch's ``FlopCounterMode``)
against hand counts from the layers' shapes: 2 FLOPs per multiply-add; the backward
twice the forward, less the first layer's input gradient (its input needs none).
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ThroughputMonitor as LightningThroughputMonitor
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bench.workload import resnet18
from gpu_busy.callbacks import SyncPointDetector, ThroughputMonitor
from gpu_busy.throughput import FlopCount

BATCH, STEPS = 64, 40


class Mlp(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 2))

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def side_by_side() -> tuple[float, float, float]:
    """(ours, Lightning's) samples/s and the steady syncs per batch with both on."""
    folder = tempfile.mkdtemp(prefix="bench-throughput-")
    ours = ThroughputMonitor(warmup_steps=1)
    theirs = LightningThroughputMonitor(batch_size_fn=lambda b: len(b[0]), window_size=STEPS)
    detector = SyncPointDetector(strict=True, first_steps=1000)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=CSVLogger(folder),
        log_every_n_steps=STEPS, callbacks=[detector, ours, theirs],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    data = DataLoader(TensorDataset(torch.randn(BATCH * STEPS, 32)), batch_size=BATCH)
    trainer.fit(Mlp(), data)
    with open(f"{folder}/lightning_logs/version_0/metrics.csv", newline="") as f:
        key = "train/device/samples_per_sec"
        lightning = float(next(r[key] for r in csv.DictReader(f) if r.get(key)))
    return ours.report["samples_per_s"], lightning, detector.report["steady_syncs_per_batch"]


def hand_count(model: nn.Module, x: torch.Tensor) -> float:
    """Forward and backward FLOPs of the convolutions and linear layers from their shapes:
    2 per multiply-add; the backward twice the forward (input and weight gradients), less
    the first layer's input gradient (``x`` needs none)."""
    forward: list[float] = []

    def conv(m, inp, out):
        k = m.kernel_size[0] * m.kernel_size[1] * m.in_channels // m.groups
        forward.append(2.0 * out.numel() * k)

    def linear(m, inp, out):
        forward.append(2.0 * out.numel() * m.in_features)

    hooks = [
        m.register_forward_hook(conv if isinstance(m, nn.Conv2d) else linear)
        for m in model.modules()
        if isinstance(m, nn.Conv2d | nn.Linear)
    ]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return 3 * sum(forward) - forward[0]


def counted(model: nn.Module, x: torch.Tensor) -> int:
    count = FlopCount()
    out = count.around(model)(x)
    count.around(out.sum().backward)()
    return count.flops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.throughput", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    for i in range(args.repeats):
        ours, lightning, syncs = side_by_side()
        print(
            f"repeat {i}: ours {ours:,.0f} samples/s, Lightning's {lightning:,.0f}: "
            f"{100 * (ours / lightning - 1):+.2f}%; steady syncs per batch with both on, "
            f"under strict: {syncs:.2f}"
        )
    x = torch.randn(4, 3, 32, 32)
    net = resnet18(width=64)
    c, h = counted(net, x), hand_count(net, x)
    print(f"ResNet-18, batch 4: counter {c:.4g}, hand {h:.4g}: {100 * (c / h - 1):+.2f}%")
    d, heads, ff, tokens, batch = 64, 4, 256, 32, 2
    layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
    # the input needs a gradient, so no input gradient is spared: 3x the forward
    hand = (
        3 * batch * (4 * 2 * tokens * d * d + 2 * 2 * tokens * tokens * d + 2 * 2 * tokens * d * ff)
    )
    c = counted(layer, torch.randn(batch, tokens, d, requires_grad=True))
    print(
        f"TransformerEncoderLayer d={d}, {heads} heads, ff {ff}, 2x{tokens} tokens: counter "
        f"{c:.4g}, hand {hand:.4g}: {100 * (c / hand - 1):+.2f}%"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
