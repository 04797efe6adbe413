"""A callback the DDP test adds from the command line: it records what each rank trained on.

Each rank writes ``shards/rank<N>.txt``: its run directory, then one line per image with
the hex digest of the image's uint8 bytes (recovered from the normalised batch). Its
per-step ``.cpu()`` is a host read of its own, which the sync detector reports; the
warning it raises on every rank is shown once.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

from gpu_busy.callbacks import StopOnSignal
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
