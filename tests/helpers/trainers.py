"""One quiet Trainer for the tests: on the CPU, printing nothing of its own, writing nothing
the test did not ask for.

Example::

    trainer = quiet_trainer(default_root_dir=tmp_path, max_steps=4, callbacks=[detector])
    trainer = quiet_trainer(logger=CSVLogger(tmp_path))     # any setting can be given back
"""

from __future__ import annotations

import tempfile
from typing import Any

import lightning.pytorch as pl

QUIET: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 1,
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "num_sanity_val_steps": 0,
}


# Without a logger the set's reports go to default_root_dir, the working directory unless
# given: a fresh folder of this one (removed when the process ends) where a test gives none.
_SCRATCH = tempfile.TemporaryDirectory(prefix="quiet-trainers-")


def quiet_trainer(**settings: Any) -> pl.Trainer:
    """A ``pl.Trainer`` with ``QUIET`` under the given settings."""
    settings.setdefault("default_root_dir", tempfile.mkdtemp(dir=_SCRATCH.name))
    return pl.Trainer(**{**QUIET, **settings})


def default_callbacks(first_steps: int = 1000) -> list[pl.Callback]:
    """The measuring package's default set without checkpoints (these fits write none), the
    sync detector watching the first ``first_steps`` batches (every batch of a short fit)."""
    from gpu_busy import defaults
    from gpu_busy.callbacks import SyncPointDetector

    return [
        SyncPointDetector(first_steps=first_steps) if isinstance(c, SyncPointDetector) else c
        for c in defaults()["callbacks"]
    ]
