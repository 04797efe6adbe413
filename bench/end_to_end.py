"""End to end: the template's default training against the plain setup a user writes first.

    python -m bench.end_to_end [--out DIR] [--steps N] [--repeats R] [--device auto|cpu|cuda]

The benchmarks' own ResNet-18 and images (``bench.workload``; as ``bench.syncs``: width 64,
batch 256, bf16-mixed on a GPU; width 16, batch 32, float32 on a CPU), the same precision,
two ways:

- ``plain``: augmentation per image in the DataLoader workers (torchvision transforms:
  random crop, flip, normalise), float32 host tensors, no pinned memory, Lightning's
  default transfer, the loss read with ``.item()`` every step for a running average, and
  ``self.log(..., prog_bar=True)`` with a progress bar refreshed every step;
- ``template``: uint8 host tensors, pinned, augmentation on the device after the copy,
  ``StreamPrefetcher``, ``StopOnSignal``, ``LoggingStepProgressBar``, metrics
  read only at logging steps (the default config's step).

Per arm, interleaved ``--repeats`` times: images per second between the end of step
``WARMUP`` and the end of the last step (synchronised at both ends), and the idle share
of the device's time from ``IdleTimeMonitor`` (CUDA events on a GPU, host clocks on a
CPU). Then one fit per arm with every step watched by ``SyncPointDetector``: syncs per
step and per steady step (neither a logging step nor the one after), all and real
(leaving out what only the CPU simulation calls a sync).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import TQDMProgressBar

from bench.results import add_device_option, chosen_device, machine, save
from bench.syncs import _setup, sync_figures, trainer_for
from bench.workload import Classifier, Images, PlainClassifier, loader_workers
from gpu_busy.callbacks import (
    IdleTimeMonitor,
    LoggingStepProgressBar,
    StopOnSignal,
    StreamPrefetcher,
    SyncPointDetector,
)

WARMUP = 5


class Throughput(pl.Callback):
    """Host time at the end of step ``WARMUP`` and of the last step, synchronised there."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.times: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step in (WARMUP, self.steps):  # global_step: finished steps
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())


def fit(arm: str, device: str, steps: int, callbacks: list) -> None:
    setup = _setup(device)
    torch.manual_seed(0)
    plain = arm == "plain"
    model = (PlainClassifier if plain else Classifier)(width=setup["width"])
    data = Images(
        batch_size=setup["batch_size"],
        train_size=setup["batch_size"] * (steps + 1),
        val_size=setup["batch_size"],
        num_workers=loader_workers(),
        pin_memory=device == "cuda" and not plain,
        host_augment=plain,
    )
    if plain:
        arm_callbacks = [TQDMProgressBar(refresh_rate=1)]
    else:
        arm_callbacks = [LoggingStepProgressBar(), StreamPrefetcher(), StopOnSignal()]
    callbacks = [*arm_callbacks, *callbacks]
    trainer_for(device, steps, callbacks, log_every_n_steps=20).fit(model, data)


def compare(device: str, steps: int, repeats: int, sync_steps: int) -> dict:
    batch = _setup(device)["batch_size"]
    rate: dict[str, list[float]] = {"plain": [], "template": []}
    idle: dict[str, list[float | None]] = {"plain": [], "template": []}
    fit("template", device, 8, [])  # the first fit in a process: imports, threads
    for _ in range(repeats):  # interleaved, so drift hits both alike
        for arm in rate:
            clock = Throughput(steps)
            monitor = IdleTimeMonitor(warmup_steps=WARMUP, picture=False, log_stats=False)
            fit(arm, device, steps, [clock, monitor])
            first, last = clock.times
            rate[arm].append(batch * (steps - WARMUP) / (last - first))
            idle[arm].append(monitor.report["mean"]["idle_pct"])
    syncs = {}
    for arm in rate:
        detector = SyncPointDetector(first_steps=10**9)
        fit(arm, device, sync_steps, [detector])
        syncs[arm] = sync_figures(detector)
    ratios = [t / p for t, p in zip(rate["template"], rate["plain"], strict=True)]
    return {
        "images_per_s": {a: statistics.median(v) for a, v in rate.items()},
        "images_per_s_each": rate,
        "speed_ratio": statistics.median(ratios),
        "speed_ratio_each": ratios,
        "idle_pct": {a: _median(v) for a, v in idle.items()},
        "idle_pct_each": idle,
        "idle_clock": "cuda events" if device == "cuda" else "host clock",
        "syncs": syncs,
    }


def run(device: str, steps: int, repeats: int, sync_steps: int = 30) -> dict:
    return {"synthetic": compare(device, steps, repeats, sync_steps)}


def table(results: dict) -> str:
    lines = [f"{'data':<10}{'arm':<10}{'images/s':>10}{'idle %':>8}{'syncs/step':>11}{'steady':>8}"]
    for name, r in results.items():
        for arm in ("plain", "template"):
            s = r["syncs"][arm]
            lines.append(
                f"{name:<10}{arm:<10}{r['images_per_s'][arm]:>10.0f}"
                f"{_fmt(r['idle_pct'][arm]):>8}{s['syncs_per_batch']:>11.2f}"
                f"{s['steady_syncs_per_batch']:>8.2f}"
            )
        each = ", ".join(f"{x:.2f}" for x in r["speed_ratio_each"])
        lines.append(
            f"{name:<10}template / plain: {r['speed_ratio']:.2f}x images/s (each repeat {each}); "
            f"idle by {r['idle_clock']}"
        )
    return "\n".join(lines)


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write end_to_end.json here")
    parser.add_argument("--steps", type=int, default=None, help="default: 200 CUDA, 60 CPU")
    parser.add_argument("--repeats", type=int, default=3)
    add_device_option(parser)
    args = parser.parse_args(argv)
    device = chosen_device(parser, args.device)
    steps = args.steps or (200 if device == "cuda" else 60)
    if steps <= WARMUP + 5:
        parser.error(f"--steps must be more than {WARMUP + 5}")
    results = {"end_to_end": run(device, steps, args.repeats)}
    results["machine"] = machine("bench.end_to_end", device, argv, steps=steps)
    save(results, args.out, "end_to_end.json")
    print(table(results["end_to_end"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
