"""What Lightning logs: which step writes to the loggers, the metrics a step stored, and the
conversion of ``prog_bar=True`` values (done when read, in one copy) with the user line
that logged each.

Example::

    if is_logging_step(trainer):          # every log_every_n_steps
        figures = expensive_reduction()
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars as _scalars
from lightning.pytorch.trainer.states import RunningStage
from torch import Tensor

from gpu_busy.host_reads import numbers_in_one_copy
from gpu_busy.patches import patch
from gpu_busy.syncs.attribution import user_frame


def is_logging_step(trainer: pl.Trainer) -> bool:
    """True in the training step whose metrics Lightning will send to the loggers.

    Lets a module do a costly reduction (a collective, a host read) only on the steps
    where the result is written, every ``log_every_n_steps``.
    """
    # Private: Trainer._logger_connector.should_update_logs (Lightning 2.0 to 2.6), the
    # property Lightning itself consults before calling the loggers. In training it
    # depends only on what the key holds (logger_connector.py:50-65 in 2.6.6): asked by
    # six hooks a step, it is computed once per step.
    if trainer.state.stage is not RunningStage.TRAINING:
        return bool(trainer._logger_connector.should_update_logs)
    key = (
        trainer.fit_loop.epoch_loop._batches_that_stepped,
        trainer.should_stop,
        trainer.log_every_n_steps,
    )
    cached = trainer.__dict__.get("_gpu_busy_logging_step")
    if cached is None or cached[0] != key:
        cached = trainer.__dict__["_gpu_busy_logging_step"] = (
            key,
            bool(trainer._logger_connector.should_update_logs),
        )
    return cached[1]


def metrics_at_last_step_end(trainer: pl.Trainer) -> dict:
    """The callback metrics as Lightning stored them at the last training step's end: the
    logged tensors, not computed again (``trainer.callback_metrics`` would)."""
    # Private: Trainer._logger_connector._callback_metrics (Lightning 2.0 to 2.6), the dict
    # _LoggerConnector.on_batch_end updates after the callbacks' on_train_batch_end.
    return dict(trainer._logger_connector._callback_metrics)


def prog_bar_numbers_when_read(trainer: pl.Trainer) -> Callable[[], None]:
    """Until the returned undo is called, Lightning converts ``prog_bar=True`` values when
    ``trainer.progress_bar_metrics`` is read, all in one copy, not with an ``.item()`` per
    value after every batch (a sync each on a GPU: Lightning's issue #21232), and hands its
    loggers a logging step's values in one copy. The numbers are the same. The undo
    converts what is left unread."""
    from lightning.pytorch.trainer.connectors.logger_connector import logger_connector, result

    connector_class = type(trainer._logger_connector)
    read = connector_class.progress_bar_metrics.fget

    def progress_bar_metrics(connector: Any) -> dict:  # LoggedAt.origin knows it by name
        return _to_numbers_in_place(read(connector))

    undos = [
        # Private: result.py's and logger_connector.py's module-level
        # convert_tensors_to_scalars (Lightning 2.0 to 2.6), called only by
        # _ResultCollection.metrics for each prog_bar value, and by
        # _LoggerConnector.log_metrics for the values it hands the loggers.
        patch(result, "convert_tensors_to_scalars", _kept_for_the_reader),
        patch(logger_connector, "convert_tensors_to_scalars", numbers_in_one_copy),
        patch(connector_class, "progress_bar_metrics", property(progress_bar_metrics)),
    ]

    def undo() -> None:
        for step in reversed(undos):
            step()
        # Private: _LoggerConnector._progress_bar_metrics (2.0 to 2.6), the dict it returns
        _to_numbers_in_place(trainer._logger_connector._progress_bar_metrics)

    return undo


def _kept_for_the_reader(value: Any) -> Any:
    """A ``prog_bar`` value as logged; Lightning's own error for more than one element."""
    return value if isinstance(value, Tensor) and value.numel() == 1 else _scalars(value)


def _to_numbers_in_place(metrics: dict) -> dict:
    if any(isinstance(v, Tensor) for v in metrics.values()):
        metrics.update(numbers_in_one_copy(metrics))
    return metrics


def logger_step(trainer: pl.Trainer) -> int:
    """The step number Lightning passes to the loggers, so rows written directly line up."""
    # Private: _TrainingEpochLoop._batches_that_stepped (Lightning 2.0 to 2.6), what
    # _LoggerConnector.log_metrics uses as ``step``.
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


_CORE = os.path.dirname(os.path.abspath(pl.LightningModule.log.__code__.co_filename)) + os.sep
_RESULT_COLLECTION = os.path.join(
    "lightning", "pytorch", "trainer", "connectors", "logger_connector", "result.py"
)
# The Trainer and its connectors: what a metric read passes through on its way from the
# reader (the loop, a progress bar, a callback reading trainer.callback_metrics).
_TRAINER_DIR = os.path.join(os.path.dirname(_CORE.rstrip(os.sep)), "trainer") + os.sep


class LoggedAt:
    """Where each ``prog_bar=True`` metric was logged, so that Lightning's conversion of it
    after the step is reported at the user's ``self.log`` line.

    Lightning turns every ``prog_bar=True`` tensor into a number after every training
    step, outside any user frame (``ResultCollection.metrics``, result.py:492 in 2.6: an
    ``.item()`` per metric). ``install()`` wraps ``LightningModule.log`` while a fit runs
    and keeps, per ``(hook, name)``, the user line that logged it; ``origin`` is a
    ``SyncDetector`` origin that finds that line from the converting frame.

    Example::

        logged = LoggedAt()
        with logged.install():
            detector = SyncDetector("cpu", origins=(logged.origin,))
    """

    def __init__(self) -> None:
        self.lines: dict[tuple[str, str], tuple[str, int, str]] = {}

    @contextlib.contextmanager
    def install(self) -> Iterator[None]:
        original = pl.LightningModule.log
        lines = self.lines

        @functools.wraps(original)
        def log(module, name, value, *args, **kwargs):
            if kwargs.get("prog_bar") or (len(args) > 0 and args[0] is True):
                # The line that logged: the user's, else the library's that called log
                # (a demo module's own training_step), past Lightning's log_dict.
                caller = sys._getframe(1)
                while caller is not None and caller.f_code.co_filename.startswith(_CORE):
                    caller = caller.f_back
                frame = user_frame(caller) or caller
                if frame is not None:
                    # Private: LightningModule._current_fx_name (Lightning 2.0 to 2.6), the
                    # ``fx`` of the ResultCollection key Lightning stores the metric under.
                    code = frame.f_code
                    lines[(module._current_fx_name, name)] = (
                        code.co_filename, frame.f_lineno, code.co_name
                    )  # fmt: skip
            return original(module, name, value, *args, **kwargs)

        undo = patch(pl.LightningModule, "log", log)
        try:
            yield
        finally:
            undo()

    def origin(self, frame: Any) -> tuple[str, int, str, Any] | None:
        """The user line that logged the metric being converted in ``frame``, and the frame
        that asked for it (the reader: the loop, a progress bar, a callback), the first
        outside the Trainer and its connectors. Where ``prog_bar_numbers_when_read``
        converts them all at a read, the reader is the line: no one ``self.log`` is."""
        code = frame.f_code
        if code is numbers_in_one_copy.__code__ and frame.f_back.f_code.co_name == "log_metrics":
            # Private: _LoggerConnector.log_metrics (2.0 to 2.6) hands the loggers their values
            asked = frame.f_back
            return asked.f_code.co_filename, asked.f_lineno, "log_metrics", asked
        if code.co_filename == __file__ and code.co_name == "progress_bar_metrics":
            reader = _reader(frame)
            if reader is None:
                return None
            asked = reader.f_code
            return asked.co_filename, reader.f_lineno, asked.co_name, reader
        if code.co_name != "metrics" or not code.co_filename.endswith(_RESULT_COLLECTION):
            return None
        # Private: the loop variable ``result_metric`` of ResultCollection.metrics and its
        # ``meta.fx``/``meta.name`` (Lightning 2.0 to 2.6): the metric being converted.
        meta = frame.f_locals["result_metric"].meta
        line = self.lines.get((meta.fx, meta.name))
        if line is None:
            return None
        return (*line, _reader(frame))


def _reader(frame: Any) -> Any:
    """The first frame outside the Trainer, its connectors and this module, past ``frame``."""
    reader = frame.f_back
    while reader is not None and (
        reader.f_code.co_filename.startswith(_TRAINER_DIR) or reader.f_code.co_filename == __file__
    ):
        reader = reader.f_back
    return reader
