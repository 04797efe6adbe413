"""Checkpoint files that survive a cluster, and reads that say what a file is before use.

``write_atomically`` stages beside the target, fsyncs and renames; ``read_checkpoint``
refuses with one line (``UnusableCheckpoint``) a file that is missing, not a ``torch.save``
archive, damaged (its CRC-32s) or holding objects other than tensors and plain data;
``resume_problem`` and ``shape_mismatches`` say whether it can resume a model. What is
checked and why: docs/ARCHITECTURE.md, "Saving and finding checkpoints".

Example::

    write_atomically("runs/x/last.ckpt", buffer.getbuffer())
    try:
        checkpoint = read_checkpoint("runs/x/last.ckpt")
    except UnusableCheckpoint as e:
        print(f"error: {e}")
"""

from __future__ import annotations

import ast
import contextlib
import csv
import errno
import os
import pickle
import re
import shutil
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning_utilities.core.apply_func import apply_to_collection

from gpu_busy.faults.stop_request import stops_deferred

# Left free beyond the file itself, so a save never takes a shared disk's last bytes.
FREE_MARGIN_BYTES = 16 * 2**20


class UnusableCheckpoint(ValueError):
    """A checkpoint file that cannot be used; the message says what it is and what to do."""


class SaveFailed(OSError):
    """A checkpoint could not be written; the previous file under its name is untouched."""


def write_atomically(path: str | os.PathLike, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a part.

    Raises ``SaveFailed`` (one line: the path, the reason, the free space) on any error.
    """
    path = Path(path)
    folder = path.parent
    stage = folder / f".{path.name}.partial-{os.getpid()}"
    try:
        # A second Ctrl+C waits for the rename; anything else that ends the write takes
        # the partial file with it.
        with stops_deferred():
            _write_staged(path, stage, data)
    except OSError as e:
        with contextlib.suppress(OSError):  # a read-only disk refuses the unlink too
            stage.unlink(missing_ok=True)
        try:
            free = f"{shutil.disk_usage(folder).free / 2**20:.0f} MiB free there"
        except OSError:
            free = "free space unknown"
        raise SaveFailed(
            e.errno,
            f"cannot save {path} ({len(data) / 2**20:.0f} MiB): {e.strerror or e}, {free}; "
            f"the checkpoints saved before it are intact",
        ) from e
    except BaseException:
        stage.unlink(missing_ok=True)
        raise


def _write_staged(path: Path, stage: Path, data: bytes | memoryview) -> None:
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(f".{path.name}.partial-*"):  # left by a killed writer
        stale.unlink(missing_ok=True)
    free = shutil.disk_usage(folder).free
    if free < len(data) + FREE_MARGIN_BYTES:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with open(stage, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(stage, path)
    _fsync_folder(folder)  # the rename itself survives a power cut


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # not every filesystem lets a folder be opened
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def plain_numbers(checkpoint: Any) -> Any:
    """``checkpoint`` with NumPy scalars as the Python numbers they hold (the same values):
    ``torch.load(weights_only=True)`` refuses NumPy's types, and a schedule computed with
    NumPy puts ``numpy.float64`` learning rates into the optimizer's and scheduler's state."""
    return apply_to_collection(checkpoint, np.generic, lambda x: x.item())


def keep_earlier_metrics(logger: Any, up_to_step: int) -> int | None:
    """A resumed run whose logger reopens the directory it resumes (a fixed version) keeps
    that run's metrics: Lightning's CSV writer deletes the ``metrics.csv`` it finds there
    when it starts (``_ExperimentWriter._check_log_dir_exists``). Its rows up to the
    checkpoint's step are read first and handed to the new writer, so the file holds the
    whole run; later rows are dropped, since the resumed run logs those steps again.
    Returns the rows kept, or None where there was nothing to keep."""
    path = Path(str(getattr(logger, "log_dir", "") or "")) / "metrics.csv"
    if not path.is_file() or not callable(getattr(logger, "log_metrics", None)):
        return None
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    kept = []
    for row in rows:
        try:
            step = int(float(row.get("step") or ""))
        except ValueError:
            continue
        if step <= up_to_step:
            kept.append((step, {k: v for k, v in row.items() if k != "step" and v != ""}))
    logger.experiment  # noqa: B018 - starts the writer, which deletes the file
    for step, metrics in kept:
        logger.log_metrics(metrics, step)
    logger.save()
    return len(kept)


def read_checkpoint(path: str | os.PathLike) -> dict:
    """The checkpoint at ``path`` as tensors and plain data (tensors memory-mapped)."""
    file = Path(path).expanduser()
    if not file.exists():
        raise UnusableCheckpoint(f"checkpoint {file} does not exist")
    if is_sharded(file):
        return _read_sharded(file)
    if not file.is_file():
        raise UnusableCheckpoint(f"checkpoint {file} is not a file")
    try:
        with zipfile.ZipFile(file) as archive:
            if not any(name.endswith("data.pkl") for name in archive.namelist()):
                raise zipfile.BadZipFile
            damaged = archive.testzip()  # reads every record and checks its CRC-32
    except (zipfile.BadZipFile, OSError, EOFError):
        raise UnusableCheckpoint(
            f"{file} is not a checkpoint written by torch.save / Lightning "
            f"({file.stat().st_size} bytes; truncated, or another kind of file)"
        ) from None
    if damaged is not None:
        raise UnusableCheckpoint(
            f"{file} is damaged: its record {damaged} no longer matches the checksum written "
            "with it (a bad disk or copy); use an earlier checkpoint"
        )
    try:
        checkpoint = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        named = re.search(r"GLOBAL ([\w.]+)", str(e))
        found = f" ({named.group(1)})" if named else ""
        raise UnusableCheckpoint(
            f"{file} holds objects other than tensors and plain data{found}; it is not "
            "loaded, because unpickling them could run code. Resave it with plain data"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise UnusableCheckpoint(
            f"{file} is not a readable checkpoint ({' '.join(str(e).split())[:160]})"
        ) from None
    if not isinstance(checkpoint, dict):
        raise UnusableCheckpoint(
            f"{file} holds a {type(checkpoint).__name__}, not a checkpoint's dictionary"
        )
    return checkpoint


DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of the shards
LIGHTNING_META = "meta.pt"  # Lightning's: everything but the weights and optimizer states


def is_sharded(path: Path) -> bool:
    """A torch.distributed.checkpoint folder (ModelParallelStrategy's, FSDPStrategy's)."""
    return path.is_dir() and (path / DCP_METADATA).is_file()


def _read_sharded(folder: Path) -> dict:
    """Lightning's part of a sharded checkpoint (``meta.pt``: loops, callbacks, hyper-
    parameters), with ``state_dict`` as meta tensors of the saved names and shapes, read
    from the shards' index: the checks need no weights, and the shards stay on disk.

    A save writes every rank's shard files, then rank zero renames ``.metadata`` into place
    once all have finished (``torch/distributed/checkpoint/filesystem.py``,
    ``FileSystemWriter.finish``), then Lightning's ``meta.pt``
    (``lightning/pytorch/strategies/model_parallel.py``, ``save_checkpoint``). Saved over
    an older one in place, a save a rank did not finish leaves a shard newer than the
    index, or an index newer than ``meta.pt``: never resumed from.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        index = FileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # any unreadable index is one answer
        raise UnusableCheckpoint(
            f"{folder} is a sharded checkpoint whose index ({DCP_METADATA}) cannot be read "
            f"({' '.join(str(e).split())[:120]})"
        ) from None
    meta = folder / LIGHTNING_META
    _check_finished(folder, {folder / info.relative_path for info in index.storage_data.values()})
    try:
        checkpoint = torch.load(meta, map_location="cpu", weights_only=True)
    except Exception as e:  # a torch.load of any damage
        raise UnusableCheckpoint(
            f"{meta} is not a readable checkpoint part ({' '.join(str(e).split())[:120]})"
        ) from None
    if not isinstance(checkpoint, dict):
        raise UnusableCheckpoint(f"{meta} holds a {type(checkpoint).__name__}, not a dictionary")
    saved = index.state_dict_metadata
    checkpoint["state_dict"] = {
        key.removeprefix("state_dict."): torch.empty(item.size, dtype=item.properties.dtype,
                                                     device="meta")
        for key, item in saved.items()
        if key.startswith("state_dict.") and isinstance(item, TensorStorageMetadata)
    }  # fmt: skip
    optimizers = {key.partition(".")[0] for key in saved if key.startswith("optimizer_")}
    if optimizers:  # their states stay in the shards
        checkpoint["optimizer_states"] = [None] * len(optimizers)
    return checkpoint


def _check_finished(folder: Path, shards: set[Path]) -> None:
    """A sharded save every rank finished: each shard written before the index, the index
    before Lightning's ``meta.pt`` (see ``_read_sharded``)."""
    missing = sorted(p.name for p in shards if not p.is_file())
    meta = folder / LIGHTNING_META
    times = [p.stat().st_mtime_ns for p in shards if p.is_file()]
    indexed = (folder / DCP_METADATA).stat().st_mtime_ns
    if missing or not meta.is_file() or max(times, default=0) > indexed:
        what = f"missing {', '.join(missing)}" if missing else "a shard newer than its index"
        what = f"no {LIGHTNING_META}" if not missing and not meta.is_file() else what
        raise UnusableCheckpoint(
            f"{folder} is a sharded checkpoint whose save did not finish ({what}: a rank "
            "stopped while writing it)"
        )
    if indexed > meta.stat().st_mtime_ns:
        raise UnusableCheckpoint(
            f"{folder} is a sharded checkpoint whose save did not finish (its {LIGHTNING_META} "
            "is older than its index: the save stopped between them)"
        )


def resume_problem(checkpoint: Mapping, path: str | os.PathLike, *, training: bool) -> str | None:
    """Why ``checkpoint`` cannot be loaded by Lightning (to train on, if ``training``), or None."""
    if "state_dict" not in checkpoint:
        if checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
            return (
                f"{path} is a plain state_dict (weights, no Lightning checkpoint around them); "
                "start from it with model.load_state_dict(torch.load(path)) in your model's "
                "__init__, or pass a checkpoint Lightning wrote"
            )
        return f"{path} is not a Lightning checkpoint (it has no state_dict)"
    if training and not {"optimizer_states", "loops"} <= checkpoint.keys():
        return (
            f"{path} holds weights only (saved with save_weights_only=True or by hand): no "
            "optimizer or loop state to resume a fit from; resume from a last.ckpt, or "
            "evaluate it with `validate` / `test`"
        )
    if training:
        steps = loop_steps(checkpoint)
        said = checkpoint.get("global_step")
        if steps is None or steps != said:
            found = "cannot be read" if steps is None else f"counts {steps}"
            return (
                f"{path} says step {said} but its loop state {found}: Lightning would restart "
                "the schedule and the data from there on these weights; resume from another "
                "checkpoint, or start a new run from its weights"
            )
    return None


def loop_steps(checkpoint: Mapping) -> int | None:
    """The optimizer steps a checkpoint's fit-loop state counts (what Lightning resumes
    ``global_step`` from: ``_TrainingEpochLoop.global_step``), or None if unreadable."""
    try:
        fit = checkpoint["loops"]["fit_loop"]
        auto = fit["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]
        manual = fit["epoch_loop.manual_optimization.optim_step_progress"]
        return int(auto["total"]["completed"]) + int(manual["total"]["completed"])
    except (KeyError, TypeError, ValueError):
        return None


def shape_mismatches(saved: Mapping[str, torch.Tensor], model: Mapping[str, torch.Tensor]):
    """``(name, saved shape, model shape)`` for the tensors both hold with different shapes."""
    return [
        (name, list(tensor.shape), list(model[name].shape))
        for name, tensor in saved.items()
        if name in model and hasattr(tensor, "shape") and tensor.shape != model[name].shape
    ]


def newest_first(paths: Iterable[Path]) -> list[Path]:
    return sorted(set(paths), key=lambda p: p.stat().st_mtime, reverse=True)


def recorded_best(checkpoint: Mapping, path: Path) -> tuple[float, str] | None:
    """``(score, mode)`` when a ModelCheckpoint recorded ``path`` as its best when it saved it.

    Lightning keys a checkpoint callback's state by its settings (monitor, mode, ...), and
    that state holds ``best_model_path`` and ``best_model_score``.
    """
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if not isinstance(state, Mapping) or state.get("best_model_score") is None:
            continue
        if Path(str(state.get("best_model_path", ""))).name != path.name:
            continue
        settings = str(key)[str(key).find("{") :]
        try:
            mode = ast.literal_eval(settings).get("mode", "min")
        except (ValueError, SyntaxError, AttributeError):
            mode = "min"
        return float(state["best_model_score"]), mode
    return None
