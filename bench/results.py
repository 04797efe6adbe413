"""What every benchmark records with its figures, and where it writes them."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch


def machine(module: str, device: str, argv: list[str] | None, **extra) -> dict:
    """The device, versions and the command that reproduces the run."""
    name = torch.cuda.get_device_name() if device == "cuda" else _cpu_name()
    return {
        "device": name or platform.machine(),
        **extra,
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "python": platform.python_version(),
        "command": f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv),
    }


def save(results: dict, out: Path | None, filename: str) -> None:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / filename).write_text(json.dumps(results, indent=2))


def _cpu_name() -> str:
    """The CPU model (Linux reports it in /proc/cpuinfo) and the cores this process may use."""
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model or platform.machine()}, {cores} cores"


def add_device_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")


def chosen_device(parser: argparse.ArgumentParser, choice: str) -> str:
    """``auto`` becomes cuda where CUDA is visible, else cpu; cuda without CUDA is an error."""
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but no CUDA device is visible here; use --device cpu")
    return choice
