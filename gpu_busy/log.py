"""Rank-aware logging: a line is written once, by rank zero, unless it is about one rank.

Under DDP every rank runs the same code, so a plain ``logging`` call prints N times.
``get_logger`` returns a logger whose calls are dropped on ranks other than zero; pass
``rank_zero_only=False`` for a message that is genuinely per-rank, and it is prefixed
with the rank that wrote it.

Example::

    log = get_logger(__name__)
    log.info("run directory: %s", run_dir)                      # once
    log.warning("no GPU visible", rank_zero_only=False)         # "[rank 1] no GPU visible"
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_only

_FORMAT = "%(asctime)s %(levelname)s %(message)s"


def current_rank() -> int:
    # Lightning sets this from the launcher's environment at import and from the strategy
    # once the process group exists, so it is the global rank wherever it is read.
    return getattr(rank_zero_only, "rank", 0) or 0


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the call (pytest swaps it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        tqdm = sys.modules.get("tqdm")
        if tqdm is None:  # no progress bar can be open
            super().emit(record)
            return
        # An open bar (Lightning's, ours) is cleared for the line and drawn again below it,
        # instead of the line starting at the end of the bar's.
        with tqdm.tqdm.external_write_mode(file=self.stream):
            super().emit(record)


class _WhenNobodyElse(_StderrHandler):
    """On this package's logger: prints a line only while the root logger has no handler,
    i.e. in a script that never configured logging. Once it is configured (``setup_logging``,
    ``logging.basicConfig``), the line reaches the root's handlers instead: never twice."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def _formatted(handler: logging.Handler) -> logging.Handler:
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    return handler


logging.getLogger("gpu_busy").addHandler(_formatted(_WhenNobodyElse()))


class RankedLogger(logging.LoggerAdapter):
    """A ``LoggerAdapter`` that writes on rank zero only, or on every rank with a prefix."""

    def log(self, level: int, msg: object, *args: Any, rank_zero_only: bool = True, **kw: Any):
        if not self.isEnabledFor(level):
            return
        rank = current_rank()
        if rank_zero_only:
            if rank != 0:
                return
        else:
            msg = f"[rank {rank}] {msg}"
        self.logger.log(level, msg, *args, **kw)


def get_logger(name: str) -> RankedLogger:
    logger = logging.getLogger(name)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)  # other libraries stay at the root's WARNING
    return RankedLogger(logger, {})


def setup_logging() -> None:
    """Send log lines to stderr with a timestamp; idempotent. On ranks other than zero,
    Python warnings are not shown: rank zero shows each once.

    The handler sits on the root logger so loggers from ``get_logger`` in your own modules
    print too. Lightning's loggers do not propagate to the root, so nothing is doubled.
    """
    root = logging.getLogger()
    if not any(getattr(h, "_template", False) for h in root.handlers):
        handler = _formatted(_StderrHandler())
        handler._template = True
        root.addHandler(handler)
    if current_rank() != 0:
        warnings.simplefilter("ignore")
