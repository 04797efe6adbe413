"""Logs that cannot be written cost their metrics, not the run.

A logger writes into the run's directory at every logging step; a cleanup script that
deletes it, a lost mount or a read-only remount then raises inside the training loop, and
the run dies before the checkpoint that would have kept its epoch. ``guard_log_writes``
wraps each logger's ``save``: a directory that is gone is made again and the write
retried; a write that still fails is said once, in one line, and training goes on (the
checkpoints report their own failures, with what is kept).

Example::

    guard_log_writes(trainer.loggers)
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from gpu_busy.log import get_logger

log = get_logger(__name__)


def guard_log_writes(loggers: Iterable[Any]) -> None:
    for logger in loggers:
        if callable(getattr(logger, "save", None)) and not isinstance(logger.save, GuardedSave):
            logger.save = GuardedSave(logger)


class GuardedSave:
    """A logger's ``save`` that survives its directory's loss. An object, not a closure:
    ``ddp_spawn`` pickles the Trainer, its loggers with it, into every rank."""

    def __init__(self, logger: Any) -> None:
        self.logger = logger
        self.said = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        save = type(self.logger).save.__get__(self.logger)  # the class's: ours replaces it
        try:
            return save(*args, **kwargs)
        except OSError as first:
            error = first
        folder = getattr(self.logger, "log_dir", None)
        if isinstance(folder, str | os.PathLike) and not os.path.isdir(folder):
            try:  # deleted under the run: make it again and write what is pending
                os.makedirs(folder, exist_ok=True)
                result = save(*args, **kwargs)
                log.warning(
                    "the run directory %s was gone: made again; the logs written there "
                    "before are lost, the checkpoints go on being saved there",
                    folder,
                )
                return result
            except OSError as again:
                error = again
        if not self.said:
            self.said = True
            log.warning(
                "cannot write the %s logs to %s (%s); training goes on without them, and "
                "checkpoints are saved as usual",
                type(self.logger).__name__,
                folder,
                error.strerror or error,
            )
        return None
