"""The one place the template reads Lightning internals.

Each private attribute below is pinned by ``tests/test_lightning_compat.py``: when a
Lightning release renames one, that test fails with the name, instead of the template
silently misbehaving.
"""

from __future__ import annotations

import lightning.pytorch as pl


def is_logging_step(trainer: pl.Trainer) -> bool:
    """True in the training step whose metrics Lightning will send to the loggers.

    Lets a module do a costly reduction (a collective, a host read) only on the steps
    where the result is written, every ``log_every_n_steps``.
    """
    # Private: Trainer._logger_connector.should_update_logs (Lightning 2.0 to 2.6), the
    # property Lightning itself consults before calling the loggers.
    return bool(trainer._logger_connector.should_update_logs)
