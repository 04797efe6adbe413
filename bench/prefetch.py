"""Prefetch benchmark: Lightning's transfer against StreamPrefetcher, side by side.

    python -m bench.prefetch [--out DIR] [--steps 40] [--repeats 3]

A transfer-heavy workload (a large float32 batch, a matmul chain sized so its compute
time is close to the batch's pinned copy time) and a compute-bound one (the same batch,
four times the compute), each run through ``Trainer.fit`` in four ways:

- ``default``:  pageable batches, Lightning's own transfer (what a first setup does);
- ``pinned``:   pinned batches, Lightning's own transfer (DataLoader ``pin_memory=True``);
- ``prefetch``: pinned batches and ``StreamPrefetcher()``;
- ``resident``: batches already on the GPU (the limit: no copy at all).

Batches are built once and cycled, so the host does no work per batch and only the copy
and the compute are measured. Step time: wall time between steps 5 and ``--steps``
(synchronised only at the two ends), median over ``--repeats`` interleaved runs. Copy
and compute alone are measured with CUDA events. Needs a CUDA device; without one it
says so and exits 0 (nothing to measure).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from bench.results import machine, save
from gpu_busy.callbacks import StreamPrefetcher

WARMUP = 5
FEATURES = 4096


class Cycle(Dataset):
    """``length`` batches drawn in turn from a few prebuilt ones (no per-batch host work)."""

    def __init__(self, batches: list[torch.Tensor], length: int) -> None:
        self.batches, self.length = batches, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.batches[i % len(self.batches)]


class MatmulChain(pl.LightningModule):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(FEATURES, FEATURES) / FEATURES**0.5)
        self.layers = layers
        self.times: list[float] = []

    def training_step(self, batch, batch_idx):
        if batch_idx in (WARMUP, self.trainer.max_steps - 1):
            torch.cuda.synchronize()  # only at the two ends of the measured window
            self.times.append(time.perf_counter())
        y = batch
        for _ in range(self.layers):
            y = torch.tanh(y @ self.w)
        return y.square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-6)


def chain_ms(x: torch.Tensor, layers: int, repeats: int = 5) -> float:
    w = torch.randn(FEATURES, FEATURES, device="cuda", requires_grad=True)
    ms = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y = x
        for _ in range(layers):
            y = torch.tanh(y @ w)
        y.square().mean().backward()
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end))
    return statistics.median(ms[1:])


def copy_ms(x: torch.Tensor, repeats: int = 5) -> float:
    ms = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x.to("cuda", non_blocking=True)
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end))
    return statistics.median(ms[1:])


def fit_once(mode: str, batches: list[torch.Tensor], layers: int, steps: int) -> float:
    if mode == "pinned" or mode == "prefetch":
        batches = [b.pin_memory() for b in batches]
    elif mode == "resident":
        batches = [b.cuda() for b in batches]
    model = MatmulChain(layers)
    loader = DataLoader(Cycle(batches, steps), batch_size=None, num_workers=0)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StreamPrefetcher()] if mode == "prefetch" else [],
    )
    trainer.fit(model, train_dataloaders=loader)
    first, last = model.times
    return 1e3 * (last - first) / (steps - 1 - WARMUP)


def run(steps: int, repeats: int) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = 8192  # 8192 x 4096 float32 = 128 MiB per batch
    host = [torch.randn(rows, FEATURES) for _ in range(3)]
    pinned = host[0].pin_memory()
    copy = copy_ms(pinned)
    unit = chain_ms(pinned.cuda(), 1)
    layers = max(1, round(copy / unit))
    results = {"copy_ms": copy, "workloads": {}}
    for name, n_layers in (("transfer-heavy", layers), ("compute-bound", 4 * layers)):
        compute = chain_ms(pinned.cuda(), n_layers)
        times: dict[str, list[float]] = {
            m: [] for m in ("default", "pinned", "prefetch", "resident")
        }
        for _ in range(repeats):  # interleaved, so drift hits every mode alike
            for mode in times:
                times[mode].append(fit_once(mode, host, n_layers, steps))
        med = {m: statistics.median(v) for m, v in times.items()}
        bound = max(copy, compute)
        results["workloads"][name] = {
            "layers": n_layers,
            "compute_ms": compute,
            "step_ms": med,
            "spread_ms": {m: [min(v), max(v)] for m, v in times.items()},
            "prefetch_vs_bound": med["prefetch"] / bound,
            "hidden_copy_pct": 100.0
            * (med["pinned"] - med["prefetch"])
            / max(1e-9, med["pinned"] - med["resident"]),
        }
    return results


def table(results: dict) -> str:
    lines = [f"copy of one batch (128 MiB, pinned): {results['copy_ms']:.2f} ms"]
    lines.append(
        f"{'workload':<15} {'compute':>8} {'default':>8} {'pinned':>8} {'prefetch':>8} "
        f"{'resident':>8} {'prefetch/max(copy,compute)':>27} {'copy hidden':>11}"
    )
    for name, w in results["workloads"].items():
        s = w["step_ms"]
        lines.append(
            f"{name:<15} {w['compute_ms']:>8.2f} {s['default']:>8.2f} {s['pinned']:>8.2f} "
            f"{s['prefetch']:>8.2f} {s['resident']:>8.2f} {w['prefetch_vs_bound']:>27.3f} "
            f"{w['hidden_copy_pct']:>10.0f}%"
        )
    lines.append("(ms per step, median; goal: prefetch within 1.10 x max(copy, compute))")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write prefetch.json here")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("prefetch benchmark: no CUDA device here, nothing to measure (not run)")
        return 0
    results = run(args.steps, args.repeats)
    results["machine"] = machine("bench.prefetch", "cuda", argv)
    save(results, args.out, "prefetch.json")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
