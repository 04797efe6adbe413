"""The checkpoint a resume means: the newest usable ``last.ckpt`` of a run, or its best.

Example::

    found = find_checkpoint("last", Path("runs/default"), folders, training=True)
    if found is not None:
        path, checkpoint = found
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from gpu_busy.errors import UserError
from gpu_busy.log import get_logger
from gpu_busy.resume import checkpoint_file

log = get_logger(__name__)


def find_checkpoint(
    which: str, root: Path, folders: list[Path], *, training: bool, said_as: str = ""
) -> tuple[Path, dict] | None:
    """The checkpoint ``--ckpt_path last`` or ``best`` means, read and checked.

    ``last``: the newest ``last*.ckpt`` of the run that passes every check; a damaged or
    unusable newer one is skipped, saying why. ``best``: of the checkpoints a
    ``ModelCheckpoint`` recorded as its best when it wrote them, the best-scoring one.
    """
    said_as = said_as or f"--ckpt_path {which}"
    pattern = "last*.ckpt" if which == "last" else "*.ckpt"
    # folders too: a sharded checkpoint is one, and is refused by name, not passed over
    found = [p for folder in folders for p in folder.glob(pattern) if p.exists()]
    if which == "last":  # SLURM's requeue saves (Lightning's hpc_ckpt_N) count as "last" too
        found += [p for p in root.glob("hpc_ckpt_*.ckpt") if p.is_file()]
    skipped: list[str] = []
    usable = _usable(checkpoint_file.newest_first(found), training, skipped)
    if which == "last":
        return _newest(usable, root, skipped, said_as)
    scored = [(*score, path, c) for path, c in usable if (score := _score(c, path)) is not None]
    if not scored:
        raise UserError(
            f"--ckpt_path best: no best checkpoint under {root} (one is written when the "
            "monitored metric improves); use --ckpt_path last or a .ckpt file"
            + (f"; skipped: {skipped[0]}" if skipped else "")
        )
    _, score, path, checkpoint = max(scored, key=lambda s: s[0])
    log.info("--ckpt_path best: %s (score %.4g)", path, score)
    return path, checkpoint


def _newest(usable: Iterator[tuple[Path, dict]], root: Path, skipped: list[str], said_as: str):
    """The first usable checkpoint (the newest), saying which newer ones were skipped."""
    first = next(usable, None)
    if first is None and skipped:
        raise UserError(f"{said_as}: no usable last.ckpt under {root}: {skipped[0]}")
    for reason in skipped:
        log.warning("%s: skipping %s", said_as, reason)
    return first


def _usable(paths: list[Path], training: bool, skipped: list[str]) -> Iterator[tuple[Path, dict]]:
    """Each checkpoint of ``paths`` that reads and can be loaded, in order; why each other
    one cannot goes into ``skipped``."""
    for path in paths:
        try:
            checkpoint = checkpoint_file.read_checkpoint(path)
        except checkpoint_file.UnusableCheckpoint as e:
            skipped.append(str(e))
            continue
        problem = checkpoint_file.resume_problem(checkpoint, path, training=training)
        if problem:
            skipped.append(problem)
            continue
        yield path, checkpoint


def _score(checkpoint: dict, path: Path) -> tuple[float, float] | None:
    """The best score a checkpoint recorded: ``(signed so that larger is better, as is)``."""
    recorded = checkpoint_file.recorded_best(checkpoint, path)
    if recorded is None:
        return None
    score, mode = recorded
    return (score if mode == "max" else -score), score


def folders_of(trainer: object) -> tuple[Path, list[Path]]:
    """Where a built Trainer's runs keep their checkpoints: ``(root, folders)``, every
    version's of its logger (``<save_dir>/<name>/*/checkpoints``), or ``default_root_dir``'s
    without one, and each checkpoint callback's ``dirpath``."""
    logger = getattr(trainer, "logger", None)
    base = Path(getattr(trainer, "default_root_dir", None) or ".")
    if logger is None:
        root = base
    else:  # a Lightning logger's root_dir is <save_dir>/<name>, above its versions
        root = Path(getattr(logger, "root_dir", None) or getattr(logger, "save_dir", None) or base)
    folders = [root / "checkpoints", *sorted(root.glob("*/checkpoints"))]
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        if getattr(callback, "dirpath", None):
            folders.append(Path(callback.dirpath))
    return root, folders
