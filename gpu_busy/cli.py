"""The training command line: a ``LightningCLI`` that says what is wrong in one line.

``python -m template.train`` is this (the example's entry point is a few lines that call
``main``); any project with its own model and data can call it the same way. In subclass
mode the LightningModule and the DataModule are whatever ``model.class_path`` and
``data.class_path`` name; ``data.num_classes`` is passed to ``model.num_classes`` where
both exist. Also:

- ``trainer.precision: null`` (the default) resolves to bf16 mixed precision on a GPU that
  supports it and to fp32 elsewhere;
- ``--ckpt_path last`` / ``best`` find the newest good ``last.ckpt`` / the best-scoring
  checkpoint of this run, with a logger or without; every checkpoint is checked before it
  loads (``gpu_busy.resume.checkpoint_file``); validate, test and predict of a checkpoint
  write inside its run;
- a mistake a user can fix (a bad key or value, a missing file, more GPUs than exist, a
  path that is not a checkpoint) is one line on stderr and exit code 2, not a traceback,
  and it is caught before any DDP process is spawned.

Example (``my_project/train.py``)::

    import sys
    from gpu_busy.cli import main
    if __name__ == "__main__":
        sys.exit(main(prog="python -m my_project.train"))
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import re
import shutil
import signal
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from jsonargparse import ArgumentError, Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from gpu_busy.callbacks.run_summary import RunSummary
from gpu_busy.config_files import (
    check_config_files,
    close_match,
    group_sections,
    key_origin,
    named_class_path,
)
from gpu_busy.errors import UserError
from gpu_busy.faults.log_writes import guard_log_writes
from gpu_busy.faults.training_stopped import TrainingStopped
from gpu_busy.log import current_rank, get_logger, setup_logging
from gpu_busy.resume import checkpoint_file
from gpu_busy.strategies import FullyShardedStrategy

log = get_logger(__name__)

# The command, as the user typed it, for the hint after a parse error (set by main).
_prog = "python"


def _command() -> str:
    """How this process was started: ``python -m pkg.mod`` or ``python path/to/script.py``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return f"python -m {spec.name.removesuffix('.__main__')}"
    return f"python {sys.argv[0]}" if sys.argv and sys.argv[0] else "python"


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


def loads_sharded(strategy: Any) -> bool:
    """Whether the config's strategy loads a torch.distributed.checkpoint folder: Lightning's
    ModelParallelStrategy and FSDPStrategy (and their subclasses) do, by class or by name."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, StrategyRegistry

    if isinstance(strategy, Namespace):
        strategy = strategy.get("class_path")
    if isinstance(strategy, str) and strategy in StrategyRegistry:
        strategy = StrategyRegistry[strategy]["strategy"]
    elif isinstance(strategy, str) and "." in strategy:
        try:
            strategy = _import_class(strategy)
        except (ImportError, AttributeError):
            return False
    cls = strategy if isinstance(strategy, type) else type(strategy)
    return issubclass(cls, (ModelParallelStrategy, FSDPStrategy))


def read_checkpoint(path: str | Path) -> dict:
    """The checkpoint at ``path`` after every check, or a ``UserError`` saying what it is."""
    try:
        return checkpoint_file.read_checkpoint(path)
    except checkpoint_file.UnusableCheckpoint as e:
        raise UserError(f"{e}; use --ckpt_path last or another .ckpt file") from None


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


def checkpoint_folders(trainer: Namespace) -> tuple[Path, list[Path]]:
    """Where this run's checkpoints go, read from its parsed config: ``(root, folders)``.

    Lightning writes them to ``<save_dir>/<name>/<version>/checkpoints`` with a logger,
    to ``<default_root_dir>/checkpoints`` without one, or to a callback's ``dirpath``.
    """
    base = Path(trainer.get("default_root_dir") or ".")
    logger = trainer.get("logger")
    if isinstance(logger, list):
        logger = logger[0] if logger else False
    if logger is False:
        root = base
    elif isinstance(logger, Namespace):
        init = logger.get("init_args") or Namespace()
        save_dir = Path(init.get("save_dir") or init.get("root_dir") or base)
        root = save_dir / str(init.get("name")) if init.get("name") else save_dir
    else:  # Lightning's default logger
        root = base / "lightning_logs"
    folders = [root / "checkpoints", *sorted(root.glob("*/checkpoints"))]
    for callback in trainer.get("callbacks") or []:
        init = callback.get("init_args") if isinstance(callback, Namespace) else None
        if init and init.get("dirpath"):
            folders.append(Path(init.get("dirpath")))
    return root, folders


def find_checkpoint(which: str, trainer: Namespace, *, training: bool) -> tuple[Path, dict] | None:
    """The checkpoint ``--ckpt_path last`` or ``best`` means, read and checked.

    ``last``: the newest ``last*.ckpt`` of the run that passes every check; a damaged or
    unusable newer one is skipped, saying why. ``best``: of the checkpoints a
    ``ModelCheckpoint`` recorded as its best when it wrote them, the best-scoring one.
    """
    root, folders = checkpoint_folders(trainer)
    pattern = "last*.ckpt" if which == "last" else "*.ckpt"
    # folders too: a sharded checkpoint is one, and is refused by name, not passed over
    found = [p for folder in folders for p in folder.glob(pattern) if p.exists()]
    if which == "last":  # SLURM's requeue saves (Lightning's hpc_ckpt_N) count as "last" too
        found += [p for p in root.glob("hpc_ckpt_*.ckpt") if p.is_file()]
    candidates = checkpoint_file.newest_first(found)
    usable, skipped = [], []
    for path in candidates:
        try:
            checkpoint = checkpoint_file.read_checkpoint(path)
        except checkpoint_file.UnusableCheckpoint as e:
            skipped.append(str(e))
            continue
        problem = checkpoint_file.resume_problem(checkpoint, path, training=training)
        if problem:
            skipped.append(problem)
            continue
        if which == "last":
            usable.append((path, checkpoint))
            break
        score = checkpoint_file.recorded_best(checkpoint, path)
        if score is not None:
            usable.append((score, path, checkpoint))
    if which == "last":
        if not usable and skipped:
            raise UserError(f"--ckpt_path last: no usable last.ckpt under {root}: {skipped[0]}")
        for reason in skipped:
            log.warning("--ckpt_path last: skipping %s", reason)
        return usable[0] if usable else None
    if not usable:
        raise UserError(
            f"--ckpt_path best: no best checkpoint under {root} (one is written when the "
            "monitored metric improves); use --ckpt_path last or a .ckpt file"
            + (f"; skipped: {skipped[0]}" if skipped else "")
        )
    (score, _), path, checkpoint = max(
        usable, key=lambda u: u[0][0] * (1 if u[0][1] == "max" else -1)
    )
    log.info("--ckpt_path best: %s (score %.4g)", path, score)
    return path, checkpoint


def replaced_hyperparameters(model: Namespace, checkpoint: dict) -> list[str]:
    """The model settings a checkpoint's saved hyperparameters replace (LightningCLI applies
    them, so the weights fit the model they were trained in)."""
    asked = model.get("init_args") or Namespace() if isinstance(model, Namespace) else Namespace()
    saved = checkpoint.get("hyper_parameters") or {}
    return [
        f"model.{key}={value!r} (this run asked for {asked.get(key)!r})"
        for key, value in saved.items()
        if not key.startswith("_") and key in asked and asked.get(key) != value
    ]


def evaluation_dir(checkpoint: Path, subcommand: str) -> Path:
    """Where validate/test/predict of ``checkpoint`` write: inside the run it came from
    (``<run>/validate-last``), so that evaluating adds no version folder beside the runs."""
    if checkpoint.parent.name == "checkpoints":
        return checkpoint.parent.parent / f"{subcommand}-{checkpoint.stem}"
    return checkpoint.parent / f"{checkpoint.stem}-{subcommand}"


def write_into(logger: object, folder: Path) -> None:
    """Point a parsed logger config (a Lightning logger's save_dir, name, version) at
    ``folder``; a logger without those keys is left as configured."""
    for one in logger if isinstance(logger, list) else [logger]:
        init = one.get("init_args") if isinstance(one, Namespace) else None
        if init is not None and "save_dir" in init and "version" in init:
            init.save_dir, init.version = str(folder.parent), folder.name
            if "name" in init:
                init.name = ""


def save_predictions(batches: list, path: Path) -> str:
    """``trainer.predict``'s per-batch outputs in one file (tensors joined along the first
    dimension, anything else as the list); returns what it holds, in words."""
    if batches and all(isinstance(b, torch.Tensor) and b.dim() > 0 for b in batches):
        held: object = torch.cat([b.detach().cpu() for b in batches])
        what = f"{len(held)} predictions"
    else:
        held, what = batches, f"{len(batches)} batches of predictions"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(held, path)
    return what


class TrainingCLI(LightningCLI):
    left_out: tuple[str, ...] | list[str] = ()  # parse_arguments: settings not carried over

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = kwargs.get("args")
        given = sys.argv[1:] if given is None else given
        self._asked = given[0] if isinstance(given, list | tuple) and given else None
        super().__init__(*args, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:
        """Only the subcommand asked for: jsonargparse reads every signature to build each
        subcommand's parser (0.15 s apiece on a 2-core CPU, a third of the start-up). All
        four where none is named first (help, a misspelt one)."""
        every = LightningCLI.subcommands()
        return {self._asked: every[self._asked]} if self._asked in every else every

    def add_arguments_to_parser(self, parser) -> None:
        # The DataModule knows its classes (for an image folder, after scanning it). Applied
        # only where the model takes num_classes and the DataModule has it.
        parser.link_arguments(
            "data.num_classes", "model.init_args.num_classes", apply_on="instantiate"
        )

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else None
        raw = list(sys.argv[1:] if args is None else args)
        self.left_out = []  # one line per group, repeated in the end-of-fit summary
        for group in ("model", "data"):
            line = leave_out_carried(group, config.get(group) if config else None, raw)
            if line:
                log.warning("%s", line)
                self.left_out.append(line)
        # Resolved and checked before LightningCLI reads the file's hyperparameters.
        self.checkpoint = None
        wanted = config.get("ckpt_path") if config else None
        if not wanted or wanted in ("hpc", "registry"):
            return
        training = subcommand == "fit"
        if wanted in ("last", "best"):
            found = find_checkpoint(wanted, config.trainer, training=training)
            if found is None:
                root, _ = checkpoint_folders(config.trainer)
                if not training:
                    raise UserError(f"--ckpt_path last: no last.ckpt under {root}")
                log.warning("--ckpt_path last: no last.ckpt under %s; training from scratch", root)
                config.ckpt_path = None
                return
            path, checkpoint = found
            config.ckpt_path = str(path)
        else:
            path, checkpoint = Path(wanted).expanduser(), read_checkpoint(wanted)
            problem = checkpoint_file.resume_problem(checkpoint, path, training=training)
            if problem:
                raise UserError(problem)
        if checkpoint_file.is_sharded(path) and not loads_sharded(config.trainer.get("strategy")):
            raise UserError(
                f"{path} is a sharded checkpoint (a torch.distributed.checkpoint folder, one "
                "file per rank): load it with a sharding strategy, STRATEGY=fsdp (--config "
                "configs/fsdp.yaml), on any number of ranks"
            )
        self.checkpoint = (path, checkpoint)
        global _resuming
        _resuming = path
        if not training:
            log.info(
                "evaluating checkpoint %s; output in %s", path, evaluation_dir(path, subcommand)
            )
        elif config.trainer.get("logger") is False:
            log.info("resuming from %s", path)
        elif _fixed_version(config.trainer.get("logger")) is not None:
            # A scheduler's fixed version reopens the run's own directory; before_fit keeps
            # the metrics Lightning's CSV writer would delete there.
            log.info(
                "resuming from %s into the same version directory (the logger's version is "
                "fixed); the metrics of the steps before it are kept in its metrics.csv",
                path,
            )
        else:
            log.info(
                "resuming from %s into a new version directory; the metrics of the steps "
                "before it stay in %s",
                path,
                path.parent.parent,
            )
        replaced = replaced_hyperparameters(config.model, checkpoint)
        if replaced:
            log.warning(
                "the checkpoint's own hyperparameters replace this run's, so its weights fit: "
                "%s. To train with other values, start a new run",
                ", ".join(replaced),
            )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config.trainer
        accelerator = str(trainer.accelerator)
        check_devices(accelerator, trainer.devices)
        check_master_port(accelerator, trainer.devices, trainer.get("num_nodes"))
        check_slurm_launch()
        accumulate = trainer.get("accumulate_grad_batches")
        if not isinstance(accumulate, int) or accumulate < 1:
            raise UserError(
                f"trainer.accumulate_grad_batches must be 1 or more, got {accumulate!r}"
            )
        if trainer.precision is None:
            trainer.precision = resolve_precision(accelerator)
        if self.subcommand != "fit" and getattr(self, "checkpoint", None) is not None:
            out = evaluation_dir(self.checkpoint[0], self.subcommand)
            write_into(trainer.get("logger"), out)
            trainer.default_root_dir = str(out)
            # Restoring a fit's checkpoint into an evaluation: the callbacks' save folders
            # differ by design, and nothing is saved.
            warnings.filterwarnings("ignore", message=r"The dirpath has changed from")
        if not trainer.get("default_root_dir"):
            # Where Lightning's SLURM requeue (SIGUSR1) saves hpc_ckpt_N.ckpt and looks for
            # it again: the run's own folder, where --ckpt_path last finds it, not the
            # working directory.
            trainer.default_root_dir = str(checkpoint_folders(trainer)[0])
        limit = trainer.get("limit_train_batches")
        if self.subcommand == "fit" and limit is not None and limit <= 0:
            raise UserError(
                f"trainer.limit_train_batches={limit:g} trains nothing; give a number of batches "
                "or a fraction of the epoch above 0"
            )
        clip = trainer.get("gradient_clip_val")
        if clip is not None and clip < 0:
            raise UserError(
                "trainer.gradient_clip_val must be 0 or more (0 or null: no clipping), "
                f"got {clip:g}"
            )

    def instantiate_classes(self) -> None:
        """The classes the config names refuse a value (an invalid strategy name, a missing
        accelerator package, a constructor's check): one line, not a traceback."""
        try:
            super().instantiate_classes()
        except (UserError, MisconfigurationException):
            raise
        except (ValueError, TypeError, ImportError) as e:
            found = _cause(e, UserError)
            if found is not None:
                raise found from None
            chain = [e]
            while chain[-1].__cause__ or chain[-1].__context__:
                chain.append(chain[-1].__cause__ or chain[-1].__context__)
            root = chain[-1]
            # Older jsonargparse keeps a constructor's error only as text, in the list of
            # reasons each type of a union (class or None) refused the value.
            pattern = r"^\s*- (.+?:)?\s*\n?\s*(\S.*)$"  # "- reason", or "- where:" then reason
            reasons = [
                f"{where or ''} {reason}".strip()
                for error in chain
                for where, reason in re.findall(pattern, str(error), flags=re.MULTILINE)
                if not reason.startswith("Expected a <class 'NoneType'>")
            ]
            message = reasons[0] if reasons else f"{type(root).__name__}: {one_line(root)}"
            raise UserError(
                "building the trainer, model or data from the config failed "
                f"({' '.join(message.split())[:240]})"
            ) from e

    def _check_checkpoint_fits_model(self) -> None:
        """Shapes compared before Lightning loads the weights (a size mismatch inside fit
        is a traceback), naming the settings that differ, such as a linked class count."""
        if self.checkpoint is None:
            return
        path, checkpoint = self.checkpoint
        saved, here = checkpoint["state_dict"], self.model.state_dict()
        missing, extra = sorted(set(here) - set(saved)), sorted(set(saved) - set(here))
        if missing or extra:
            parts = []
            if missing:
                parts.append(
                    f"{len(missing)} tensor(s) of this model missing there ({missing[0]}, ...)"
                )
            if extra:
                parts.append(f"{len(extra)} there that this model lacks ({extra[0]}, ...)")
            raise UserError(
                f"{path} does not fit this model: {'; '.join(parts)}; resume it with its own "
                "model, or start a new run"
            )
        differ = checkpoint_file.shape_mismatches(saved, here)
        if not differ:
            return
        name, saved, here = differ[0]
        settings = [
            f"{key}={value!r} there, {self.model.hparams[key]!r} here"
            for key, value in (checkpoint.get("hyper_parameters") or {}).items()
            if key in self.model.hparams and self.model.hparams[key] != value
        ]
        because = f"; its settings differ: {', '.join(settings)}" if settings else ""
        raise UserError(
            f"{path} does not fit this model: {name} is {saved} there and {here} here "
            f"({len(differ)} tensor(s) differ{because}); resume it with its own model and "
            "data, or start a new run"
        )

    def before_fit(self) -> None:
        if isinstance(self.trainer.strategy, FullyShardedStrategy):
            FullyShardedStrategy.check_model(self.model)  # once, before any rank starts
        self._check_checkpoint_fits_model()
        for callback in self.trainer.callbacks:
            if isinstance(callback, RunSummary):
                callback.notes = list(self.left_out)  # said again under the summary
        logger = self.trainer.logger
        root = Path(logger.root_dir) if logger is not None else Path(self.trainer.default_root_dir)
        check_writable(root)
        guard_log_writes(self.trainer.loggers)
        if self.checkpoint is not None and logger is not None and current_rank() == 0:
            step = int(self.checkpoint[1].get("global_step") or 0)
            checkpoint_file.keep_earlier_metrics(logger, up_to_step=step)

    before_validate = before_test = before_predict = _check_checkpoint_fits_model

    def after_predict(self) -> None:
        predictions = self.trainer.predict_loop.predictions
        if not predictions:
            return
        folder = (
            evaluation_dir(self.checkpoint[0], "predict")
            if self.checkpoint is not None
            else Path(self.trainer.default_root_dir)
        )
        world = self.trainer.world_size
        # Under DDP each rank predicts every world_size-th sample (Lightning's
        # DistributedSampler, unshuffled): rank r's file holds samples r, r + world, ...
        name = "predictions.pt" if world == 1 else f"predictions.rank{self.trainer.global_rank}.pt"
        what = save_predictions(predictions, folder / name)
        log.info("predict: %s written to %s (torch.load it)", what, folder / name)


def leave_out_carried(group: str, final: object, args: list[str]) -> str | None:
    """Give ``group``'s class its own defaults for the settings the config files made for
    another class (``carried_settings``); the line that says which, or None.

    A subclass of the class they were set for keeps them: they mean to it what they mean
    to its base. A carried setting the class requires (no default) stops the run.
    """
    carried = carried_settings(group, final, args)
    if not carried:
        return None
    path = final.class_path
    carried = {k: (v, owner) for k, (v, owner) in carried.items() if not _subclass_of(path, owner)}
    if not carried:
        return None
    try:
        parameters = inspect.signature(_import_class(path)).parameters
    except (TypeError, ValueError, ImportError, AttributeError):
        parameters = {}
    # Where the class's own default is the carried value, nothing changes: nothing to say.
    carried = {
        k: (v, owner) for k, (v, owner) in carried.items()
        if k not in parameters or not _same(parameters[k].default, v)
    }  # fmt: skip
    if not carried:
        return None
    own = []
    for name in carried:
        default = getattr(parameters.get(name), "default", None)
        if default is inspect.Parameter.empty:
            value, owner = carried[name]
            raise UserError(
                f"{group}: {path} needs {name}, which the config files set only for {owner} "
                f"({name}={value!r}); pass --{group}.{name}=<value>"
            )
        if name in parameters:
            final.init_args[name] = default
            own.append(f"{name}={default!r}")
        else:  # taken through **kwargs: the default is the one the class passes on
            del final.init_args[name]
            own.append(f"{name} (its default)")
    owners = " and ".join(sorted({owner for _, owner in carried.values()}))
    given = ", ".join(f"{k}={v!r}" for k, (v, _) in carried.items())
    return (
        f"{group}: {path} does not take {given} from the config files (set there for "
        f"{owners}); it trains with its own {', '.join(own)}; pass --{group}.<name>=<value> "
        "to choose"
    )


def _same(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:  # a value that cannot say (an array): not the same
        return False


def carried_settings(group: str, final: object, args: list[str]) -> dict[str, tuple]:
    """The ``init_args`` of ``group`` ("model", "data") that reach its class only because a
    config file set them for another class: ``{name: (value, that class)}``.

    jsonargparse keeps the ``init_args`` a new ``class_path`` also accepts, so swapping in
    your own model on the command line hands it the example's learning rate. A value
    counts as carried when a ``--config`` file set it while another class was in effect
    there, the final config holds that same value, and the command line did not set it.
    """
    if not isinstance(final, Namespace) or not final.get("class_path"):
        return {}
    given = set()
    for arg in args:
        if arg.startswith(f"--{group}."):
            given.add(arg[len(group) + 3 :].split("=", 1)[0].removeprefix("init_args."))
    values = final.get("init_args") or Namespace()
    carried: dict[str, tuple] = {}
    current = None
    for section in group_sections(group, args):
        if not isinstance(section, dict):
            continue
        current = section.get("class_path", current)
        settings = section.get("init_args") or {
            k: v for k, v in section.items() if k not in ("class_path", "init_args")
        }
        if current is None or current == final.class_path or not isinstance(settings, dict):
            continue
        for name, value in settings.items():
            if name not in given and name in values and values.get(name) == value:
                carried[name] = (value, current)
    return carried


def _fixed_version(logger: object) -> object:
    """The version a logger's config fixes (a scheduler's job name), or None."""
    return logger.get("init_args.version") if isinstance(logger, Namespace) else None


# The groups LightningCLI adds to every subcommand, beside the subcommand's own arguments.
CLI_GROUPS = ("config", "trainer", "model", "data", "seed_everything", "optimizer", "lr_scheduler")


def unknown_key_line(message: str, args: list[str]) -> str | None:
    """jsonargparse's "option not accepted" as one line: the key, where it was set (which
    config file, or the command line) and the accepted name closest to it."""
    found = re.search(r"does not accept option '([^']+)'", message) or re.search(
        r"unrecognized arguments: --([^\s=]+)", message
    )
    if found:
        key = found.group(1)
    else:
        found = re.search(r'Parser key "([^"]+)":.*?Option \'([^\']+)\' is not accepted', message,
                          flags=re.DOTALL)  # fmt: skip
        if not found:
            return None
        key = f"{found.group(1)}.init_args.{found.group(2)}"
    parts = [part for part in key.split(".") if part != "init_args"]
    origin = key_origin(key, args) or "the command line"
    subcommand = next((a for a in args if not a.startswith("-")), "fit")
    # The misspelt part is the first one its level does not accept ("modle" in modle.lr).
    match = None
    for depth, part in enumerate(parts):
        accepted = _accepted_names(parts[:depth], subcommand, args)
        if part not in accepted:
            match = close_match(part, accepted)
            if match:
                match = ".".join([*parts[:depth], match, *parts[depth + 1 :]])
            break
    suggestion = f"; did you mean {match}?" if match else ""
    return f"{origin}: {'.'.join(parts)} is not an option{suggestion}"


def _accepted_names(parent: list[str], subcommand: str, args: list[str]) -> set[str]:
    """The names accepted under ``parent`` (best effort: for a suggestion only)."""
    if not parent:
        run = getattr(pl.Trainer, subcommand, None)
        own = set(inspect.signature(run).parameters) if run else set()
        skipped = LightningCLI.subcommands().get(subcommand, set())
        return (own - {"self"} - skipped) | set(CLI_GROUPS)
    if parent == ["trainer"]:
        return set(inspect.signature(pl.Trainer.__init__).parameters) - {"self"}
    if len(parent) == 1 and parent[0] in ("model", "data"):
        try:
            cls = _class_named(parent[0], args)
            return set(inspect.signature(cls.__init__).parameters) - {"self", "args", "kwargs"}
        except Exception:  # a class that does not import: no suggestion, the line stands
            return set()
    return set()


def _import_class(path: str) -> type:
    module, _, name = str(path).rpartition(".")
    return getattr(importlib.import_module(module), name)


def _subclass_of(path: str, base: str) -> bool:
    try:
        return issubclass(_import_class(path), _import_class(base))
    except Exception:  # not importable here: jsonargparse says so, or it is not a class
        return False


def _class_named(group: str, args: list[str]) -> type:
    """The class ``group`` ends up with (``config_files.named_class_path``)."""
    return _import_class(str(named_class_path(group, args)))


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
    line = f'Parser key "{key}": {last[-1].strip()}'
    # Under a union (class_path), the reason is nested below the list of subtypes.
    problem = re.search(r"- (Problem with given class_path '[^']+'):\s*\n\s*([^\n]+)", message)
    if problem:
        line += f" ({problem.group(1)}: {problem.group(2).strip()})"
    return line


def one_line(error: BaseException) -> str:
    """An error's message on one line. Raised in a DataLoader worker, it arrives wrapped
    in the worker's traceback text, whose last line is ``module.Type: message``."""
    text = str(error).strip()
    last = text.splitlines()[-1] if text else type(error).__name__
    prefix = f"{type(error).__module__}.{type(error).__name__}: "
    return last.removeprefix(prefix)


_resuming: Path | None = None  # the checkpoint this run resumes, once resolved


def _raised_in_restore(error: BaseException) -> bool:
    """Whether ``error`` came out of Lightning's restore of a checkpoint's training state."""
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.endswith("checkpoint_connector.py") and code.co_name.startswith(
            "restore"
        ):
            return True
        tb = tb.tb_next
    return False


def _raised_by_lightning(error: BaseException) -> bool:
    """Whether the innermost frame of ``error`` is Lightning's own code."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = tb.tb_frame.f_code.co_filename if tb is not None else ""
    return f"{os.sep}lightning{os.sep}" in where and "-packages" in where


def _cause(error: BaseException | None, kind: type | tuple[type, ...]) -> BaseException | None:
    while error is not None and not isinstance(error, kind):
        error = error.__cause__ or error.__context__
    return error


# Printed on every run by the libraries, with nothing for a user to change: torch's
# all_gather notice under DDP (torch 2.10+), the deprecation torch raises inside Lightning's
# own _pytree.py (Lightning's to fix), and Lightning's advertisement for its cloud logger.
QUIET_WARNINGS = (
    r"torch\.distributed\.nn\.functional\.all_gather",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
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
    global _resuming
    _resuming = None
    try:
        check_config_files(sys.argv[1:] if args is None else args)
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
    except (UserError, MisconfigurationException) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    except checkpoint_file.SaveFailed as e:
        print(f"error: {e.strerror}", file=sys.stderr)
        return 1
    except ArgumentError as e:
        raw = sys.argv[1:] if args is None else list(args)
        line = unknown_key_line(str(e), raw) or argument_error_line(str(e))
        print(f"error: {line} ({_prog} fit --help lists every option)", file=sys.stderr)
        return 2
    except (KeyError, RuntimeError, ValueError) as e:
        if _resuming is not None and _raised_in_restore(e):
            # Lightning restores the optimizer and schedule inside fit: a checkpoint saved
            # with other parameter groups or without a schedule fails there.
            print(
                f"error: {_resuming} does not fit this run ({one_line(e)}); resume it with "
                "the model, optimizer and schedule it was saved with, or start a new run",
                file=sys.stderr,
            )
            return 2
        if not isinstance(e, ValueError):
            raise
        # jsonargparse builds the classes a config names under union types, and reports what
        # their __init__ raised inside a ValueError of its own.
        cause = _cause(e, (UserError, ImportError))
        if cause is None and _raised_by_lightning(e):
            # Lightning's own check of a setting it can only test in fit (val_check_interval
            # against the number of batches): a setting to change, not a crash.
            print(f"error: {one_line(e)}", file=sys.stderr)
            return 2
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
