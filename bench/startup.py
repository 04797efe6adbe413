"""Start-up: seconds from the command line to the first training step, one process and DDP.

    python -m bench.startup [--out DIR] [--repeats R]

Runs the package's command line (``python -m gpu_busy.cli fit``, what ``make train`` runs
after its install check) for a few steps with the default config's trainer and callbacks
and the benchmarks' own small model and data (``bench.workload``), with ``FirstStep``
added as a callback: rank zero prints the wall-clock time at which its first training
step starts. Measured twice per repeat: one process, and 2-process DDP (two GPUs where
visible, else 2 CPU processes on gloo, which is what a machine without two GPUs can run).
The time includes Python and torch imports, building the model and data, Lightning's
set-up and, under DDP, launching and connecting the second process.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import yaml

from bench.results import machine, save

ROOT = Path(__file__).resolve().parents[1]
MARK = "first training step at"
DEFAULT_CONFIG = ROOT / "configs" / "default.yaml"
WORKLOAD = (
    {"class_path": "bench.workload.Classifier", "init_args": {"width": 8}},
    {"class_path": "bench.workload.Images", "init_args": {"batch_size": 32, "train_size": 512}},
)


class FirstStep(pl.Callback):
    """Prints when rank zero starts its first training step (time.time(), seconds)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 0 and batch_idx == 0 and trainer.is_global_zero:
            print(f"{MARK} {time.time():.6f}", flush=True)


def command(ddp: bool, save_dir: str) -> tuple[list[str], str]:
    """The package's command line (``python -m gpu_busy.cli fit``) with the default config's
    trainer and default set, the benchmarks' own model and data, and ``FirstStep``."""
    default = yaml.safe_load(DEFAULT_CONFIG.read_text()) if DEFAULT_CONFIG.is_file() else {}
    trainer, options = default.get("trainer") or {}, default.get("gpu_busy") or {}
    config = Path(save_dir) / "startup.yaml"
    config.write_text(yaml.safe_dump(
        {"trainer": trainer, "gpu_busy": options, "model": WORKLOAD[0], "data": WORKLOAD[1]}
    ))  # fmt: skip
    flags = [
        "--config", str(config), "--trainer.max_steps=3", "--trainer.log_every_n_steps=2",
        f"--trainer.logger.init_args.save_dir={save_dir}",
        "--trainer.callbacks+=bench.startup.FirstStep",
    ]  # fmt: skip
    if not ddp:
        kind = "1 GPU" if torch.cuda.is_available() else "1 CPU process"
    elif torch.cuda.device_count() >= 2:
        flags += ["--trainer.accelerator=gpu", "--trainer.devices=2"]
        kind = "2 GPUs"
    else:
        flags += ["--trainer.accelerator=cpu", "--trainer.devices=2"]
        kind = "2 CPU processes (gloo)"
    return [sys.executable, "-m", "gpu_busy.cli", "fit", *flags], kind


def launch(ddp: bool, save_dir: str) -> dict:
    argv, kind = command(ddp, save_dir)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    total = time.time() - t0
    found = re.search(rf"{MARK} ([0-9.]+)", done.stdout + done.stderr)
    if done.returncode != 0 or found is None:
        tail = (done.stdout + done.stderr)[-2000:]
        raise RuntimeError(f"{argv[0]} {argv[1]} failed (rc {done.returncode}):\n{tail}")
    return {
        "processes": kind,
        "command": "python -m gpu_busy.cli fit",
        "to_first_step_s": float(found.group(1)) - t0,
        "total_s": total,
    }


def run(repeats: int) -> dict:
    runs: dict[str, list[dict]] = {"single": [], "ddp": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            for name in runs:
                runs[name].append(launch(name == "ddp", tmp))
    return {
        name: {
            "processes": r[0]["processes"],
            "to_first_step_s": statistics.median(x["to_first_step_s"] for x in r),
            "spread_s": [
                min(x["to_first_step_s"] for x in r),
                max(x["to_first_step_s"] for x in r),
            ],
            "each": r,
        }
        for name, r in runs.items()
    }


def table(results: dict) -> str:
    lines = ["start-up, the command line to the first training step (median [min, max]):"]
    for name, r in results.items():
        lo, hi = r["spread_s"]
        lines.append(
            f"  {name:<7} {r['to_first_step_s']:6.1f} s  [{lo:.1f}, {hi:.1f}]  {r['processes']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write startup.json here")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {"startup": run(args.repeats)}
    results["machine"] = machine("bench.startup", device, argv)
    save(results, args.out, "startup.json")
    print(table(results["startup"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
