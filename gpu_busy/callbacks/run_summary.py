"""The end-of-fit output, written once by rank zero: a verdict line, the reports, a summary.

The other callbacks' reports, held back during fit, are printed here under the line that
says what bounds the run (``gpu_busy.report.verdict``), then one paragraph whose score is
the metric the best-checkpoint callback monitors. Throughput goes to ``run.json`` for
``python -m gpu_busy.report.compare``.

Example::

    trainer = Trainer(callbacks=[IdleTimeMonitor(), RunSummary()])
    # 12:01:07 INFO verdict: bound by data loading: the device waited 41.20 ms per batch ...
    # 12:01:07 INFO fit done in 95.2 s: 3 epoch(s), 234 steps over 2 process(es), 59,904
    #          samples; val/acc 0.951; best checkpoint runs/...
"""

from __future__ import annotations

import time

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from gpu_busy.callbacks.measurement import Measurement
from gpu_busy.callbacks.ranks import gather_rows, publish, run_dir
from gpu_busy.callbacks.step_clock import StepClock
from gpu_busy.log import get_logger
from gpu_busy.report import run as run_report
from gpu_busy.report.held import HeldReports

log = get_logger(__name__)


class RunSummary(Measurement):
    """Logs where the run lives at the start of fit and what it achieved at the end."""

    label = "the run summary"
    at_stop = ("on_fit_end", "teardown")  # teardown prints the held reports and the summary

    def __init__(self) -> None:
        self._first_step = 0
        self._fit_start = 0.0
        self._val_start = 0.0
        self._val_seconds = 0.0
        self._summary: tuple[dict, str] | None = None  # (run.json, the paragraph)
        self._run_dir = None
        self.held_reports = HeldReports()  # the other callbacks' reports (ranks.publish)
        # Lines said at the start that must not scroll away (a setting the config files made
        # for another class and the run's class did not take): said again under the summary.
        self.notes: list[str] = []

    def add_run_notes(self, lines: list[str]) -> None:
        """Lines said at the start to say again under the summary (the command line's)."""
        self.notes = list(lines)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._val_seconds, self._summary = 0.0, None
        self._fit_start = time.perf_counter()
        if trainer.is_global_zero:
            self.held_reports.start()
        # trainer.log_dir is broadcast from rank zero: the same directory on every rank.
        self._run_dir = run_dir(trainer)
        if self._run_dir is None:
            where = "none: the logger has no folder, the reports are printed only"
        elif not trainer.loggers:
            where = f"{self._run_dir} (no logger: the reports go to default_root_dir)"
        else:
            where = str(self._run_dir)
        log.info(
            "run directory %s; %d process(es) on %s, precision %s",
            where,
            trainer.world_size,
            trainer.strategy.root_device.type,
            trainer.precision,
        )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_step = trainer.global_step  # not 0 in a resumed run

    def on_validation_start(self, trainer, pl_module) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        self._val_seconds += time.perf_counter() - self._val_start

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        elapsed = time.perf_counter() - self._fit_start
        # The samples the step clock counted (IdleTimeMonitor's or ThroughputMonitor's): -1
        # without one, or where a batch had no size Lightning could find.
        clock = StepClock.of(trainer)
        samples = clock.samples if clock is not None and clock.samples is not None else -1
        rows = gather_rows(trainer, [samples, elapsed - self._val_seconds])
        checkpoint, best = _best_checkpoint(trainer), None
        if checkpoint is not None:
            score = trainer.callback_metrics.get(checkpoint.monitor)
            score = None if score is None else float(score)  # the fit is over: a read is free
            best = (checkpoint.monitor, score, checkpoint.best_model_path)
        self._summary = run_report.summary(
            rows,
            elapsed=elapsed,
            steps=trainer.global_step - self._first_step,
            epochs=trainer.current_epoch,
            first_step=self._first_step,
            resumed_from=trainer.ckpt_path,
            best=best,
        )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """After every callback's on_fit_end: the verdict, the held reports, the summary."""
        held = self.held_reports.take()
        if stage != "fit" or not trainer.is_global_zero:
            return
        run, paragraph = self._summary or (None, None)
        for line in run_report.under_verdict(held, run):
            log.info("%s", line)
        if run is not None:
            self._summary = None
            publish(trainer, "run", run, [paragraph], self._run_dir)
        for note in self.notes:
            log.warning("%s", note)


def _best_checkpoint(trainer: pl.Trainer) -> ModelCheckpoint | None:
    """The first checkpoint callback that keeps the best by a monitored metric."""
    return next(
        (c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.monitor),
        None,
    )
