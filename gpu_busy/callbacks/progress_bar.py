"""A TQDM progress bar that reads metrics back from the device only at logging steps.

Lightning converts every ``prog_bar=True`` metric to a number after *every* training step
(an ``.item()``, a host-device sync, per metric per step). While this bar runs, Lightning
converts them only when ``trainer.progress_bar_metrics`` is read, all in one copy
(``lightning_compat.prog_bar_numbers_when_read``), and this bar reads none of them in
training: the values a logging step logged start one copy to the host at the next step,
which nothing waits for (``LateRead``), taken at the next logging step (nothing is asked
of the device in between: docs/ARCHITECTURE.md, "CUDA calls per step"), so the bar shows
the last window's values. In validation and at epoch ends, where the loop has waited
anyway, they are read directly.

Example::

    trainer = Trainer(callbacks=[LoggingStepProgressBar()], log_every_n_steps=20)
    # training_step: self.log("train/loss", loss, prog_bar=True)     (no sync per step)
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.progress_bar import get_standard_metrics
from torch import Tensor

from gpu_busy import lightning_compat as compat
from gpu_busy.host_reads import LateRead
from gpu_busy.syncs import allow_syncs


class LoggingStepProgressBar(TQDMProgressBar, compat.Callback):
    """``TQDMProgressBar`` that shows logged metrics, read only where reading costs nothing new.

    Args:
        refresh_rate: batches between refreshes of the counter.
        leave: keep each epoch's bar on screen.
        min_interval: seconds between refreshes at least (as tqdm's ``mininterval``), so that
            short steps do not pay for a refresh every ``refresh_rate`` batches.
        metrics: names of logged metrics to show (None: every scalar logged metric,
            without the ``_step``/``_epoch`` duplicates).
    """

    def __init__(
        self,
        refresh_rate: int = 1,
        leave: bool = False,
        metrics: list[str] | None = None,
        min_interval: float = 0.5,
    ) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        self.metrics = metrics
        self.min_interval = min_interval
        self._refreshed = float("-inf")
        self._shown: dict[str, float] = {}
        self._late = LateRead()  # the last logging step's values, on their way to the host
        self._sent: list[str] = []  # their names
        self._sent_now: dict[str, float] = {}  # what it logged as numbers or host tensors
        self._send_now = False  # the last step was a logging step
        self._undo: Callable[[], None] | None = None

    def setup(self, trainer, pl_module, stage) -> None:
        super().setup(trainer, pl_module, stage)
        if self._undo is None:  # Lightning converts prog_bar values when they are read
            self._undo = compat.prog_bar_numbers_when_read(trainer)

    def teardown(self, trainer, pl_module, stage) -> None:
        self._put_back()
        super().teardown(trainer, pl_module, stage)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._put_back()
        # Lightning closes no bar on an exception: its last line would stay open, and the
        # reports and the "stopped:" line after it would start on that line
        for name in ("val_progress_bar", "train_progress_bar"):
            with contextlib.suppress(TypeError):  # never opened: Lightning's property refuses
                getattr(self, name).close()

    def _put_back(self) -> None:
        if self._undo is not None:
            self._undo, undo = None, self._undo
            undo()

    def get_metrics(self, trainer, pl_module) -> dict:
        if not trainer.training or trainer.sanity_checking:
            self._shown = self._read(trainer)
            # the version number and any prog_bar metric, read where the loop has waited
            return {**super().get_metrics(trainer, pl_module), **self._shown}
        # logged values as the last logging step sent them: nothing read from the device here
        return {**get_standard_metrics(trainer), **self._shown}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if compat.is_logging_step(trainer):
            self._take()  # what the last logging step sent: once a window, never waited for
        if self._send_now:  # the step before logged: its values are Lightning's now
            self._send(trainer, compat.metrics_at_last_step_end(trainer))
        self._send_now = compat.is_logging_step(trainer)
        n, bar = batch_idx + 1, self.train_progress_bar
        last = bar is not None and n == bar.total
        now = time.monotonic()
        # A refresh formats and writes the bar (about 0.4 ms): at most every min_interval
        # seconds, however short the step.
        if last or (
            n % max(1, self.refresh_rate) == 0 and now - self._refreshed >= self.min_interval
        ):
            self._refreshed = now
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._send_now = False
        super().on_train_epoch_start(trainer, pl_module)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # Once per epoch: shows the epoch-level values (on_epoch=True) Lightning just reduced.
        self._shown = self._read(trainer)
        super().on_train_epoch_end(trainer, pl_module)

    def _wanted(self, metrics: dict) -> list[tuple[str, object]]:
        return [
            (name, value)
            for name, value in metrics.items()
            if (
                name in self.metrics if self.metrics is not None else not name.endswith(_DUPLICATES)
            )
            and (not isinstance(value, Tensor) or value.numel() == 1)
        ]

    def _send(self, trainer, metrics: dict) -> None:
        """The device's values in one copy to the host, not waited for; the rest (numbers,
        host tensors) as they are."""
        device = trainer.strategy.root_device
        names, values, now = [], [], {}
        for name, value in self._wanted(metrics):
            if isinstance(value, Tensor) and value.device == device:
                names.append(name)
                values.append(value.detach().reshape(()).float())
            elif isinstance(value, Tensor) and value.device.type == "cpu":
                now[name] = value.detach().reshape(()).float().tolist()
            elif isinstance(value, (int, float)):
                now[name] = value
        self._sent, self._sent_now = names, now
        if values:
            self._late.put(torch.stack(values))
        else:
            self._shown = _finite(now)

    def _take(self) -> None:
        if (values := self._late.take(wait=False)) is not None:
            self._shown = _finite({**self._sent_now, **dict(zip(self._sent, values, strict=True))})

    def _read(self, trainer) -> dict[str, float]:
        shown = {}
        with allow_syncs("LoggingStepProgressBar reads logged metrics after validation"):
            for name, value in self._wanted(trainer.callback_metrics):
                shown[name] = value.item() if isinstance(value, Tensor) else value
        return _finite(shown)


_DUPLICATES = ("_step", "_epoch")


def _finite(values: dict) -> dict[str, float]:
    return {k: v for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}
