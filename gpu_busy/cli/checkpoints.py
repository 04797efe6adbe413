"""Which checkpoint ``--ckpt_path`` means, read and checked, and where evaluating it writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace

from gpu_busy.config_files import import_class
from gpu_busy.errors import UserError
from gpu_busy.log import get_logger
from gpu_busy.resume import checkpoint_file
from gpu_busy.resume.last_saved import find_checkpoint

log = get_logger(__name__)


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
            strategy = import_class(strategy)
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


def fixed_version(logger: object) -> object:
    """The version a logger's config fixes (a scheduler's job name), or None."""
    return logger.get("init_args.version") if isinstance(logger, Namespace) else None


def resolve_checkpoint(config: Namespace, subcommand: str) -> tuple[Path, dict] | None:
    """The checkpoint ``--ckpt_path`` names, read and checked (``last`` and ``best`` found,
    and written back into ``config``); None where there is none to load."""
    wanted = config.get("ckpt_path")
    if not wanted or wanted in ("hpc", "registry"):
        return None
    training = subcommand == "fit"
    if wanted in ("last", "best"):
        found = find_checkpoint(wanted, *checkpoint_folders(config.trainer), training=training)
        if found is None:
            root, _ = checkpoint_folders(config.trainer)
            if not training:
                raise UserError(f"--ckpt_path last: no last.ckpt under {root}")
            log.warning("--ckpt_path last: no last.ckpt under %s; training from scratch", root)
            config.ckpt_path = None
            return None
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
    return path, checkpoint


def say_what_loads(config: Namespace, subcommand: str, path: Path, checkpoint: dict) -> None:
    """One line on where the run that loads ``path`` writes, and a warning naming the
    settings the checkpoint's own replace."""
    logger = config.trainer.get("logger")
    if subcommand != "fit":
        log.info("evaluating checkpoint %s; output in %s", path, evaluation_dir(path, subcommand))
    elif logger is False:
        log.info("resuming from %s", path)
    elif fixed_version(logger) is not None:
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
