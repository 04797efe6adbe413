"""What the command line checks before any process is spawned: the run folder can be
written, a cluster launch is whole, a taken MASTER_PORT, the precision for the device.

Example::

    check_master_port(trainer.num_devices * trainer.num_nodes)   # UserError if taken
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import torch

from gpu_busy.errors import UserError

# Set by a launcher that starts every process itself (torchrun, SLURM's srun) or by
# Lightning in the processes it starts: their master port is that launcher's business.
_LAUNCHED = ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_PROCID")


def check_master_port(processes: int) -> None:
    """A MASTER_PORT already taken makes rank zero fail while the others wait for it: say
    so before any of the ``processes`` Lightning counted is started."""
    port = os.environ.get("MASTER_PORT")
    if not port or processes < 2 or any(name in os.environ for name in _LAUNCHED):
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
