"""``main``: run the command line and turn every mistake a user can fix into one line."""

from __future__ import annotations

import logging
import sys
import warnings

import lightning.pytorch as pl
import torch
from jsonargparse import ArgumentError
from lightning.fabric.utilities.exceptions import MisconfigurationException

from gpu_busy import outcomes
from gpu_busy.cli.error_lines import (
    argument_error_line,
    cause_of,
    raised_by_lightning,
    raised_in_restore,
)
from gpu_busy.cli.keys import KeyNotAccepted
from gpu_busy.cli.parser import TrainingCLI
from gpu_busy.config_files import check_config_files
from gpu_busy.errors import UserError
from gpu_busy.log import setup_logging
from gpu_busy.outcomes import one_line

# The command, as the user typed it, for the hint after a parse error (set by main).
_prog = "python"


def _command() -> str:
    """How this process was started: ``python -m pkg.mod`` or ``python path/to/script.py``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return f"python -m {spec.name.removesuffix('.__main__')}"
    return f"python {sys.argv[0]}" if sys.argv and sys.argv[0] else "python"


# all_gather notice under DDP (torch 2.10+), the deprecation torch raises inside Lightning's
# own _pytree.py (Lightning's to fix), and Lightning's advertisement for its cloud logger.
QUIET_WARNINGS = (
    r"torch\.distributed\.nn\.functional\.all_gather",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # main passes LightningCLI the arguments it has checked (sys.argv's, by default): ours to
    # do, not the user's mistake the warning suspects
    r"LightningCLI's args parameter is intended",
)
QUIET_LOG_LINES = ("💡 Tip: For seamless cloud logging",)


def _quiet(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(QUIET_LOG_LINES)


def main(args: list[str] | None = None, prog: str | None = None) -> int:
    """Run the command line (``args``: sys.argv's by default) and return the exit code;
    ``prog`` is how the user runs it, for the hints (default: how this process started)."""
    global _prog
    _prog = prog or _command()
    setup_logging()
    # TF32 matmuls on Ampere and newer GPUs, for this run only: a caller in the same process
    # (a test, a notebook) gets its own setting back, and its warning filters.
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    lightning_info = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    lightning_info.addFilter(_quiet)
    try:
        with warnings.catch_warnings():
            for message in QUIET_WARNINGS:
                warnings.filterwarnings("ignore", message=message)
            return _run(args)
    finally:
        lightning_info.removeFilter(_quiet)
        torch.set_float32_matmul_precision(precision)


def _run(args: list[str] | None) -> int:
    TrainingCLI.resuming = None
    args = sys.argv[1:] if args is None else list(args)

    def fit() -> None:
        check_config_files(args)
        TrainingCLI(
            pl.LightningModule,  # any subclass: model.class_path in the config
            None,  # any LightningDataModule subclass (data.class_path), or none: --data=null
            # A resumed or repeated run writes its config next to its own logs.
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            # No abbreviations: --trainer.max_epoch=1 is a misspelling, not max_epochs.
            parser_kwargs={"exit_on_error": False, "allow_abbrev": False},
            args=args,
        )

    return outcomes.run(fit, lambda e: _cli_line(e, args), resume_hint="--ckpt_path last")


def _cli_line(e: BaseException, args: list[str]) -> outcomes.Said | None:
    """The lines only the command line has (its parser's, its config's); the rest are the
    run's (``gpu_busy.outcomes``)."""
    help_hint = f"({_prog} fit --help lists every option)"
    if isinstance(e, KeyNotAccepted):
        return f"error: {e} {help_hint}", 2
    if isinstance(e, ArgumentError):
        return f"error: {argument_error_line(e, args)} {help_hint}", 2
    if isinstance(e, MisconfigurationException):  # a config value Lightning refused
        return f"error: {one_line(e)}", 2
    if isinstance(e, KeyError | RuntimeError | ValueError):
        line = _setting_error_line(e)
        return None if line is None else (f"error: {line}", 2)
    return None


def _setting_error_line(e: KeyError | RuntimeError | ValueError) -> str | None:
    """A fit's error that a setting or a checkpoint caused, as its line; None for a crash."""
    if TrainingCLI.resuming is not None and raised_in_restore(e):
        # Lightning restores the optimizer and schedule inside fit: a checkpoint saved
        # with other parameter groups or without a schedule fails there.
        return (
            f"{TrainingCLI.resuming} does not fit this run ({one_line(e)}); resume it with the "
            "model, optimizer and schedule it was saved with, or start a new run"
        )
    if not isinstance(e, ValueError):
        return None
    # jsonargparse builds the classes a config names under union types, and reports what
    # their __init__ raised inside a ValueError of its own.
    cause = cause_of(e, (UserError, ImportError))
    if cause is None and raised_by_lightning(e):
        # Lightning's own check of a setting it can only test in fit (val_check_interval
        # against the number of batches): a setting to change, not a crash.
        return one_line(e)
    if isinstance(cause, ImportError):  # its last line names the package wanted
        return f"{str(cause).strip().splitlines()[-1]} (a class in the config needs it)"
    return None if cause is None else str(cause)
