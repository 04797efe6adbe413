"""The committed default's step against the same model's step in a plain PyTorch loop.

    python -m bench.plain_step [--device cuda] [--repeats 2] [--batch-size 1024] [--width 64]

``template``: a Trainer with every callback and plugin ``configs/default.yaml`` lists, its
model (``ImageClassifier``, channels-last on CUDA) and data (the embedded synthetic set, its
DataLoader and device augmentation), bf16-mixed on a GPU that has it. ``plain``: the same
network, DataLoader, augmentation, optimizer and precision in a loop of plain PyTorch (the
batch moved with ``non_blocking=True``), no Lightning, no callbacks. Each arm's step is the
wall time over steps 10 to 46 of the second epoch, between two ``synchronize()`` calls, so
both are timed by one clock; the arms alternate ``--repeats`` times. The goal: template /
plain at most 1.05 on a GPU machine (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger

from bench.host import default_config_parts
from bench.results import chosen_device
from gpu_busy.syncs import allow_syncs
from template.data import ImageDataModule
from template.models import ImageClassifier

EPOCH = 48  # optimizer steps in an epoch of the embedded data (configs/default.yaml)
FIRST, LAST = EPOCH + 10, EPOCH + 46  # the timed steps: inside the second epoch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class _WallClock(pl.Callback):
    """The wall time from the end of step FIRST to the end of step LAST."""

    def __init__(self, device: str) -> None:
        self.device, self.at = device, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step in (FIRST, LAST):
            with allow_syncs("bench.plain_step times the window by the wall clock"):
                _sync(self.device)
            self.at[trainer.global_step] = time.perf_counter()

    def ms(self) -> float:
        return 1e3 * (self.at[LAST] - self.at[FIRST]) / (LAST - FIRST)


def _parts(device: str, batch_size: int, width: int) -> tuple[ImageClassifier, ImageDataModule]:
    model = ImageClassifier(width=width, channels_last=device == "cuda")
    data = ImageDataModule(
        dataset="synthetic", batch_size=batch_size, synthetic_steps_per_epoch=EPOCH,
        synthetic_val_size=2 * batch_size,
    )  # fmt: skip
    return model, data


def _precision(device: str) -> str:
    return "bf16-mixed" if device == "cuda" and torch.cuda.is_bf16_supported() else "32-true"


def template_ms(device: str, batch_size: int, width: int) -> float:
    callbacks, plugins = default_config_parts()
    clock = _WallClock(device)
    model, data = _parts(device, batch_size, width)
    with tempfile.TemporaryDirectory() as folder:
        trainer = pl.Trainer(
            accelerator=device, devices=1, precision=_precision(device), max_steps=LAST + 1,
            log_every_n_steps=20, logger=CSVLogger(folder), callbacks=[*callbacks, clock],
            plugins=plugins, default_root_dir=folder, enable_model_summary=False,
        )  # fmt: skip
        torch.manual_seed(0)
        trainer.fit(model, data)
    return clock.ms()


def plain_ms(device: str, batch_size: int, width: int) -> float:
    torch.manual_seed(0)
    model, data = _parts(device, batch_size, width)
    data.setup("fit")
    net = model.net.to(device)
    if device == "cuda":
        net = net.to(memory_format=torch.channels_last)
    augment = data.device_augment.to(device)
    augment.channels_last = device == "cuda"
    decay = [p for p in net.parameters() if p.ndim > 1]
    rest = [p for p in net.parameters() if p.ndim <= 1]
    optimizer = torch.optim.SGD(
        [{"params": decay, "weight_decay": 5e-4}, {"params": rest}],
        lr=0.1, momentum=0.9, nesterov=True,
    )  # fmt: skip
    bf16 = _precision(device) == "bf16-mixed"
    step, at = 0, {}
    while step <= LAST:
        for images, labels in data.train_dataloader():
            images = augment(images.to(device, non_blocking=True), train=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(net(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step in (FIRST, LAST):
                _sync(device)
                at[step] = time.perf_counter()
            if step > LAST:
                break
    return 1e3 * (at[LAST] - at[FIRST]) / (LAST - FIRST)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plain_step", description=__doc__)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args(argv)
    device = chosen_device(parser, args.device)
    ms: dict[str, list[float]] = {"plain": [], "template": []}
    for repeat in range(args.repeats):
        arms = [("plain", plain_ms), ("template", template_ms)]
        for name, arm in arms[:: 1 if repeat % 2 == 0 else -1]:
            ms[name].append(arm(device, args.batch_size, args.width))
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    plain, template = statistics.median(ms["plain"]), statistics.median(ms["template"])
    print(f"device: {name}; torch {torch.__version__}, lightning {pl.__version__}; "
          f"batch {args.batch_size}, width {args.width}, {_precision(device)}")  # fmt: skip
    print(f"step ms, steps {FIRST}-{LAST}, median of {args.repeats}: plain PyTorch {plain:.2f} "
          f"{ms['plain']}, template {template:.2f} {ms['template']}")  # fmt: skip
    print(f"template / plain: {template / plain:.3f} (goal <= 1.05 on a GPU machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
