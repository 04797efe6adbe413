"""One quiet Trainer for the tests: on the CPU, printing nothing of its own, writing nothing
the test did not ask for.

Example::

    trainer = quiet_trainer(default_root_dir=tmp_path, max_steps=4, callbacks=[detector])
    trainer = quiet_trainer(logger=CSVLogger(tmp_path))     # any setting can be given back
"""

from __future__ import annotations

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


def quiet_trainer(**settings: Any) -> pl.Trainer:
    """A ``pl.Trainer`` with ``QUIET`` under the given settings."""
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
