"""Which checkpoint ``--ckpt_path`` means, read and checked, and where evaluating it writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace

from gpu_busy.cli.carried import import_class
from gpu_busy.errors import UserError
from gpu_busy.log import get_logger
from gpu_busy.resume import checkpoint_file

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


def fixed_version(logger: object) -> object:
    """The version a logger's config fixes (a scheduler's job name), or None."""
    return logger.get("init_args.version") if isinstance(logger, Namespace) else None
