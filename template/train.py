"""Entry point: ``python -m template.train fit --config configs/default.yaml [--key=value ...]``.

A ``LightningCLI`` in subclass mode: the LightningModule and the DataModule are whatever
``model.class_path`` and ``data.class_path`` name (``configs/default.yaml`` names the
example's), so training your own is a config edit or ``--model.class_path=my.Model``.
``data.num_classes`` is passed to ``model.num_classes`` where both exist. Also:

- ``trainer.precision: null`` (the default) resolves to bf16 mixed precision on a GPU that
  supports it and to fp32 elsewhere;
- ``--ckpt_path last`` finds the newest ``last.ckpt`` of this run name under ``runs/``;
- a mistake a user can fix (a bad key or value, a missing file, more GPUs than exist, a
  path that is not a checkpoint) is one line on stderr and exit code 2, not a traceback,
  and it is caught before any DDP process is spawned.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import signal
import sys
import warnings
import zipfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from jsonargparse import ArgumentError
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from gpu_busy.faults.training_stopped import TrainingStopped
from gpu_busy.log import current_rank, get_logger, setup_logging
from template.errors import UserError

log = get_logger(__name__)

USAGE_HINT = "python -m template.train fit --help lists every option"


def _requested_gpus(devices) -> int | None:
    """How many GPUs the trainer settings ask for, or None for "auto" / "all"."""
    if isinstance(devices, int):
        return devices if devices >= 0 else None  # -1 means "all"
    if isinstance(devices, str):
        if devices in ("auto", "-1"):
            return None
        if devices.strip().lstrip("-").isdigit():
            return int(devices)
        return len([d for d in devices.split(",") if d.strip()])
    if isinstance(devices, list | tuple):
        return len(devices)
    return None


def check_devices(accelerator: str, devices) -> None:
    """Refuse, before anything is spawned, to run on more GPUs than this machine has."""
    if accelerator not in ("gpu", "cuda"):
        return
    wanted = _requested_gpus(devices) or 1  # "auto" / -1 need at least one
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if wanted > found:
        fewer = f"`make train GPUS={found}`" if found else "`make train` (the CPU)"
        raise UserError(
            f"asked for {wanted} GPU(s) but found {found}; run {fewer}, or "
            f"`make train ACCELERATOR=cpu DEVICES={wanted}` for {wanted}-process DDP on the CPU"
        )


def resolve_precision(accelerator: str) -> str:
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if on_gpu:
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"


def check_checkpoint(path: str) -> None:
    """A checkpoint given by path must exist and be a file ``torch.save`` wrote."""
    file = Path(path).expanduser()
    if not file.exists():
        raise UserError(f"checkpoint {file} does not exist; use --ckpt_path last or a .ckpt file")
    if not file.is_file():
        raise UserError(f"checkpoint {file} is not a file")
    # torch.save writes a zip archive holding a data.pkl: anything else is not a checkpoint.
    try:
        with zipfile.ZipFile(file) as archive:
            is_torch = any(name.endswith("data.pkl") for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        is_torch = False
    if not is_torch:
        raise UserError(f"{file} is not a checkpoint written by torch.save / Lightning")
    # Loaded as data only (weights_only): unpickling arbitrary objects could run code. mmap
    # keeps this cheap: tensor bytes are not read.
    try:
        torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        named = re.search(r"GLOBAL ([\w.]+)", str(e))
        found = f" ({named.group(1)})" if named else ""
        raise UserError(
            f"{file} holds objects other than tensors and plain data{found}; it is not "
            "loaded, because unpickling them could run code. Resave it with plain data"
        ) from e
    except (RuntimeError, EOFError, OSError) as e:
        raise UserError(
            f"{file} is not a readable checkpoint ({' '.join(str(e).split())[:160]})"
        ) from e


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


def find_last_checkpoint(run_root: Path) -> Path | None:
    """The newest ``last.ckpt`` of any version under ``run_root`` (``runs/<name>``)."""
    candidates = sorted(
        run_root.glob("version_*/checkpoints/last*.ckpt"), key=lambda p: p.stat().st_mtime
    )
    return candidates[-1] if candidates else None


class TemplateCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # The DataModule knows its classes (for an image folder, after scanning it). Applied
        # only where the model takes num_classes and the DataModule has it.
        parser.link_arguments(
            "data.num_classes", "model.init_args.num_classes", apply_on="instantiate"
        )

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        # Check a checkpoint path before LightningCLI opens the file to read its hyperparameters.
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and ckpt_path not in ("last", "best", "hpc", "registry"):
            check_checkpoint(ckpt_path)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config.trainer
        accelerator = str(trainer.accelerator)
        check_devices(accelerator, trainer.devices)
        if trainer.precision is None:
            trainer.precision = resolve_precision(accelerator)

    def before_fit(self) -> None:
        logger = self.trainer.logger
        root = Path(logger.root_dir) if logger is not None else Path(self.trainer.default_root_dir)
        check_writable(root)
        # Lightning's own "last" looks only in this run's new version directory; resuming
        # means the newest last.ckpt of any earlier version of this run name.
        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") != "last":
            return
        last = find_last_checkpoint(root)
        if last is None:
            log.warning("--ckpt_path last: no last.ckpt under %s; training from scratch", root)
            config["ckpt_path"] = None
        else:
            # A resumed run writes to a new version directory: Lightning's CSVLogger would
            # delete the old one's metrics.csv if it reopened it.
            log.info(
                "resuming from %s into a new version directory under %s; the metrics of the "
                "steps before it stay in %s",
                last,
                root,
                last.parent.parent,
            )
            config["ckpt_path"] = str(last)


def argument_error_line(message: str) -> str:
    """jsonargparse's nested, multi-line error as one line that names the full key.

    In subclass mode a bad ``--data.batch_size`` is reported under ``Parser key "data"``,
    then ``Parser key "batch_size"``, then the reason on that line or the next.
    """
    keys = re.findall(r'Parser key "([^"]+)":', message)
    last = re.findall(r'Parser key "[^"]+":[ \t]*\n?\s*([^\n]*)', message)
    if not keys:
        return " ".join(message.split())
    key = ".".join(k for k in keys if k != "init_args")
    return f'Parser key "{key}": {last[-1].strip()}'


def _cause(error: BaseException | None, kind: type | tuple[type, ...]) -> BaseException | None:
    while error is not None and not isinstance(error, kind):
        error = error.__cause__ or error.__context__
    return error


def main(args: list[str] | None = None) -> int:
    setup_logging()
    # Said once per rank by Lightning's all_gather (torch 2.10+); nothing a user can change.
    warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_gather")
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere and newer GPUs
    try:
        TemplateCLI(
            pl.LightningModule,  # any subclass: model.class_path in the config
            None,  # any LightningDataModule subclass (data.class_path), or none: --data=null
            # A resumed or repeated run writes its config next to its own logs.
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"exit_on_error": False},
            args=args,
        )
    except (UserError, MisconfigurationException) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ArgumentError as e:
        print(f"error: {argument_error_line(str(e))} ({USAGE_HINT})", file=sys.stderr)
        return 2
    except ValueError as e:
        # jsonargparse builds the classes a config names under union types, and reports what
        # their __init__ raised inside a ValueError of its own.
        cause = _cause(e, (UserError, ImportError))
        if cause is None:
            raise
        if isinstance(cause, ImportError):  # its last line names the package wanted
            cause = f"{str(cause).strip().splitlines()[-1]} (a class in the config needs it)"
        print(f"error: {cause}", file=sys.stderr)
        return 2
    except TrainingStopped as e:
        # Every rank stops at the same check; rank zero says why and its code is the run's.
        # The others leave quietly with 0: Lightning's launcher ends the whole group, rank
        # zero included, when one of its ranks exits non-zero.
        if current_rank() != 0:
            return 0
        print(f"{'error' if e.failure else 'stopped'}: {e}", file=sys.stderr)
        return e.exit_code
    except SIGTERMException:
        # Lightning's own handler, still in place before training starts.
        print("stopped: SIGTERM before training began; nothing to save", file=sys.stderr)
        return 128 + signal.SIGTERM
    return 0


if __name__ == "__main__":
    sys.exit(main())
