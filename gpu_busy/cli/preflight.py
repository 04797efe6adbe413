"""What the command line checks before anything is built or spawned: the run folder can be
written, a cluster launch is whole, a taken MASTER_PORT, the precision for the device."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import torch

from gpu_busy.errors import UserError


def _requested_gpus(devices) -> int | None:
    """How many devices the trainer settings ask for, or None for "auto" / "all" (-1).

    Lightning takes a count, -1 or "auto", or device indices ("0,1", [0, 1]); anything else
    is a ``UserError`` here, before Lightning's own check deep inside the trainer.
    """
    if isinstance(devices, str):
        text = devices.strip()
        if text in ("auto", "-1"):
            return None
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if text.isdigit() and int(text) > 0:
            return int(text)
        if "," in text and parts and all(p.isdigit() for p in parts):
            return len(parts)
    elif isinstance(devices, int) and not isinstance(devices, bool):
        if devices > 0:
            return devices
        if devices == -1:
            return None
    elif (
        isinstance(devices, list | tuple)
        and devices
        and all(isinstance(d, int) and d >= 0 for d in devices)
    ):
        return len(devices)
    raise UserError(
        f"trainer.devices must be a count (1, 2, ...), -1 or 'auto' for all, or device "
        f"indices such as 0,1; got {devices!r}"
    )


def check_devices(accelerator: str, devices) -> None:
    """Refuse, before anything is spawned, to run on more GPUs than this machine has."""
    wanted = _requested_gpus(devices) or 1
    if accelerator not in ("gpu", "cuda"):
        return  # "auto" / -1 need at least one
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if wanted > found:
        fewer = f"`make train GPUS={found}`" if found else "`make train` (the CPU)"
        raise UserError(
            f"asked for {wanted} GPU(s) but found {found}; run {fewer}, or "
            f"`make train ACCELERATOR=cpu DEVICES={wanted}` for {wanted}-process DDP on the CPU"
        )


# Set by a launcher that starts every process itself (torchrun, SLURM's srun) or by
# Lightning in the processes it starts: their master port is that launcher's business.
_LAUNCHED = ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_PROCID")


def check_master_port(accelerator: str, devices, num_nodes) -> None:
    """A MASTER_PORT already taken makes rank zero fail while the others wait for it: say
    so before any process is started."""
    port = os.environ.get("MASTER_PORT")
    if not port or any(name in os.environ for name in _LAUNCHED):
        return
    count = _requested_gpus(devices)
    if count is None:  # "auto" / -1: every GPU, else one process on the CPU
        count = torch.cuda.device_count() if accelerator in ("gpu", "cuda", "auto") else 1
    if count * int(num_nodes or 1) < 2:
        return
    try:
        with socket.socket() as probe:
            probe.bind((os.environ.get("MASTER_ADDR", ""), int(port)))
    except (OSError, ValueError) as e:
        raise UserError(
            f"MASTER_PORT={port} cannot be used on this machine ({e.strerror or e}); unset it "
            "(Lightning then picks a free port) or choose a free one"
        ) from None


def check_slurm_launch() -> None:
    """SLURM's variables for several tasks make Lightning wait for all of them; a process
    started without ``srun`` (a batch script's ``python ...``) is the only one, and would
    wait forever at "Initializing distributed". ``srun`` sets ``SLURM_STEP_NUM_TASKS`` for
    the tasks it starts; Lightning ignores SLURM in an interactive job ("bash")."""
    tasks = os.environ.get("SLURM_NTASKS")
    if not tasks or os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return
    if int(tasks) > 1 and os.environ.get("SLURM_STEP_NUM_TASKS") != tasks:
        raise UserError(
            f"SLURM's environment has {tasks} tasks, but this process was not started by "
            "srun for them (SLURM_STEP_NUM_TASKS is "
            f"{os.environ.get('SLURM_STEP_NUM_TASKS', 'unset')}): put srun in front of the "
            "command in your batch script, or ask for one task per GPU with --ntasks-per-node"
        )


def resolve_precision(accelerator: str) -> str:
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if on_gpu:
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"


MIN_FREE_BYTES = 256 * 2**20  # a few checkpoints of the example model, with room to spare


def check_writable(run_root: Path) -> None:
    """Refuse to start training when the run directory cannot be written or its disk is full.

    Found before the first step, this is one line; found at the first checkpoint, it would
    be a traceback after the work of an epoch.
    """
    fix = "pass --trainer.logger.init_args.save_dir=<a writable folder>"
    try:
        run_root.mkdir(parents=True, exist_ok=True)
        probe = run_root / f".write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
        free = shutil.disk_usage(run_root).free
    except OSError as e:
        raise UserError(
            f"cannot write the run directory {run_root}: {e.strerror or e}; {fix}"
        ) from e
    if free < MIN_FREE_BYTES:
        raise UserError(
            f"cannot write the run directory {run_root}: only {free / 2**20:.0f} MiB free on its "
            f"disk; free some space or {fix}"
        )
