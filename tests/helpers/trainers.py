"""One quiet Trainer for the tests: on the CPU, printing nothing of its own, writing nothing
the test did not ask for.

Example::

    trainer = quiet_trainer(default_root_dir=tmp_path, max_steps=4, callbacks=[detector])
    trainer = quiet_trainer(logger=CSVLogger(tmp_path))     # any setting can be given back
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import yaml

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
    """The measuring package's callbacks as configs/default.yaml lists them, the sync
    detector watching the first ``first_steps`` batches (every batch of a short fit)."""
    from tests.conftest import DEFAULT

    out = []
    for spec in yaml.safe_load(Path(DEFAULT).read_text())["trainer"]["callbacks"]:
        module, name = spec["class_path"].rsplit(".", 1)
        if not module.startswith("gpu_busy") or name == "BestCheckpoint":
            continue  # these fits write no checkpoints
        args = dict(spec.get("init_args") or {})
        if name == "SyncPointDetector":
            args["first_steps"] = first_steps
        out.append(getattr(importlib.import_module(module), name)(**args))
    return out
