"""OneWriterPerCheckpoint: two checkpoint callbacks that would write one file end the fit
before anything is written, with one line naming both.

A script's own ``ModelCheckpoint(save_last=True)`` beside another with
``filename="last"`` (a config's, a module's ``configure_callbacks``), in one folder, both
write ``last.ckpt``: each replaces the other's file, one of them perhaps from a background
thread, and ``--ckpt_path last`` resumes whichever wrote last. Lightning lets both run.
Two that keep Lightning's version counter on (its default) never overwrite each other's
files (the second writes ``last-v1.ckpt``): they are a pair Lightning handles, accepted.
The check runs at ``on_fit_start``, once every ``ModelCheckpoint`` has resolved its folder
in its own ``setup`` and before any save.

Example::

    trainer = Trainer(callbacks=[OneWriterPerCheckpoint(), ModelCheckpoint(save_last=True),
                                 ModelCheckpoint(filename="last")])
    trainer.fit(model)
    # UserError: ModelCheckpoint(save_last=True) and ModelCheckpoint(filename="last") both
    #   write last.ckpt in .../checkpoints: give one of them another dirpath or filename
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from gpu_busy import lightning_compat as compat
from gpu_busy.errors import UserError

# ModelCheckpoint's name for a top-k file when it is given no filename (model_checkpoint.py,
# _format_checkpoint_name: "{epoch}-{step}" with the metric names inserted)
_DEFAULT_FILENAME = "{epoch}-{step}"


class OneWriterPerCheckpoint(compat.Callback):
    """Refuse a fit whose checkpoint callbacks would write the same file."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        line = colliding(trainer.checkpoint_callbacks)
        if line is not None:
            raise UserError(line)


def colliding(callbacks: list) -> str | None:
    """One line naming two ``ModelCheckpoint`` callbacks that write one file (the same
    folder and the same name, or name pattern, and one of them without the version
    counter that would write beside the other's file), or None."""
    writers: dict[tuple[str, str], tuple[ModelCheckpoint, str]] = {}
    for callback in callbacks:
        if not isinstance(callback, ModelCheckpoint) or getattr(callback, "dirpath", None) is None:
            continue  # no folder yet, or a stand-in (a Mock of the class) without one
        folder = os.path.realpath(callback.dirpath)
        for name, described in _names(callback):
            key = (folder, name + callback.FILE_EXTENSION)
            other, other_described = writers.setdefault(key, (callback, described))
            if other is not callback and not (
                compat.never_overwrites(other) and compat.never_overwrites(callback)
            ):
                return (
                    f"{other_described} and {described} both write {key[1]} in "
                    f"{callback.dirpath}: give one of them another dirpath or filename, or "
                    "drop one"
                )
    return None


def _names(callback: ModelCheckpoint) -> list[tuple[str, str]]:
    """The names (patterns) a checkpoint callback writes, each with how it was asked for."""
    kind = type(callback).__name__
    names = []
    if callback.save_top_k != 0:
        filename = callback.filename or _DEFAULT_FILENAME
        names.append((filename, f"{kind}(filename={callback.filename!r})"))
    if callback.save_last:
        names.append((callback.CHECKPOINT_NAME_LAST, f"{kind}(save_last={callback.save_last!r})"))
    return names
