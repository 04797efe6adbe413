"""The private members of Lightning's classes that the template's subclasses set or extend.

Example::

    class BestCheckpoint(SaveGatedCheckpoint):
        def save_due(self, trainer, monitor_candidates):
            return self.monitor in monitor_candidates
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint


def never_overwrites(callback: ModelCheckpoint) -> bool:
    """Whether a ``ModelCheckpoint`` writes ``name-v1.ckpt`` beside a file of another's
    rather than over it (``enable_version_counter=True``, Lightning's default)."""
    # Private: ModelCheckpoint._enable_version_counter (Lightning 2.0 to 2.6), what
    # _get_metric_interpolated_filepath_name and _save_last_checkpoint read
    # (callbacks/model_checkpoint.py:888 and :912 in 2.6.6).
    return bool(callback._enable_version_counter)


def set_data_parallel_size(strategy: Any, size: int) -> None:
    """A ``ModelParallelStrategy``'s data-parallel size, before its ``setup_environment``."""
    # Private: ModelParallelStrategy._data_parallel_size (Lightning 2.4 to 2.6), which
    # setup_environment reads to build the device mesh (strategies/model_parallel.py:147-152
    # in 2.6.6), resolving "auto" to the number of nodes. Renamed, a one-node mesh would be
    # tensor-parallel: tests/contracts/test_lightning_compat.py pins it.
    strategy._data_parallel_size = size


class SaveGatedCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that asks ``save_due`` before each of its top-k saves (the ones
    that read the monitor); ``last.ckpt`` is saved as usual."""

    def save_due(self, trainer: pl.Trainer, monitor_candidates: dict) -> bool:
        return True

    def _save_topk_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict) -> None:
        # Private: ModelCheckpoint._save_topk_checkpoint (Lightning 2.0 to 2.6,
        # callbacks/model_checkpoint.py:574 in 2.6.6), where every top-k save first looks
        # for the monitor among the metrics it read, and raises when it is missing after a
        # validation.
        if self.save_due(trainer, monitor_candidates):
            super()._save_topk_checkpoint(trainer, monitor_candidates)
