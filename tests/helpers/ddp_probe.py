"""Callbacks the DDP test adds from the command line: what each rank trained on, and the
collectives each step asked for.

Each rank writes ``shards/rank<N>.txt``: its run directory, then one line per image with
the hex digest of the image's uint8 bytes (recovered from the normalised batch). Its
per-step ``.cpu()`` is a host read of its own, which the sync detector reports; the
warning it raises on every rank is shown once.
"""

from __future__ import annotations

import hashlib
import json
import traceback
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

from gpu_busy.callbacks import StopOnSignal
from gpu_busy.lightning_compat import is_logging_step
from gpu_busy.log import get_logger

log = get_logger(__name__)


class RecordShards(pl.Callback):
    def __init__(self) -> None:
        self.digests: list[str] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        # What a library warns on every rank, which the run shows once.
        warnings.warn("every rank warns this", UserWarning, stacklevel=1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        augment = trainer.datamodule.device_augment
        raw = ((batch[0] - augment.shift) / augment.scale).round().to(torch.uint8).cpu()
        self.digests += [hashlib.sha1(image.numpy().tobytes()).hexdigest() for image in raw]

    def on_fit_end(self, trainer, pl_module) -> None:
        out = Path("shards")
        out.mkdir(exist_ok=True)
        lines = [trainer.log_dir, *self.digests]
        (out / f"rank{trainer.global_rank}.txt").write_text("\n".join(lines))
        checks = [c.checks for c in trainer.callbacks if isinstance(c, StopOnSignal)]
        log.info(
            "trained on %d images; stop checks %s", len(self.digests), checks,
            rank_zero_only=False,
        )  # fmt: skip


_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
    "broadcast_object_list", "reduce", "barrier", "gather", "scatter", "reduce_scatter_tensor",
    "all_to_all",
)  # fmt: skip


class CountCollectives(pl.Callback):
    """Counts the collectives ``torch.distributed`` is asked for during training, by the
    kind of step they fall in (a logging step or a steady one, from one batch's start to the
    next's) and by whose code asked: gpu_busy's, or anyone else's (Lightning, the model).
    Each rank writes ``shards/collectives_rank<N>.json``."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.steps = {"logging": 0, "steady": 0}
        self._kind: str | None = None
        self._saved: dict = {}

    def on_train_start(self, trainer, pl_module) -> None:
        # First in the list (a new list: Lightning is iterating the old one): a step's kind
        # is set before any callback's hook, and ends before validation's hooks.
        trainer.callbacks = [self, *(c for c in trainer.callbacks if c is not self)]
        for name in _COLLECTIVES:
            original = self._saved[name] = getattr(torch.distributed, name)
            setattr(torch.distributed, name, self._counted(original))

    def _counted(self, original):
        def counted(*args, **kwargs):
            if self._kind is not None:
                key = f"{self._kind} {_whose(traceback.extract_stack()[:-1])}"
                self.counts[key] = self.counts.get(key, 0) + 1
            return original(*args, **kwargs)

        return counted

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._kind = "logging" if is_logging_step(trainer) else "steady"
        self.steps[self._kind] += 1

    def on_validation_start(self, trainer, pl_module) -> None:
        self._kind = None  # no training step's

    on_train_epoch_end = on_validation_start

    def on_train_end(self, trainer, pl_module) -> None:
        self._kind = None
        for name, original in self._saved.items():
            setattr(torch.distributed, name, original)
        out = Path("shards")
        out.mkdir(exist_ok=True)
        path = out / f"collectives_rank{trainer.global_rank}.json"
        path.write_text(json.dumps({"steps": self.steps, "counts": self.counts}))


def _whose(frames) -> str:
    """ "ours" where the innermost caller outside torch and Lightning is gpu_busy's (its
    command line, which runs the whole fit, aside), else "others"."""
    for frame in reversed(frames):
        name = frame.filename
        if "/torch/" in name or "/lightning/" in name:
            continue
        return "ours" if "/gpu_busy/" in name and "/gpu_busy/cli/" not in name else "others"
    return "others"
