"""IdleTimeMonitor: how long the GPU sat idle in each training step, and why.

Always on: the fit's step timer (``StepClock``) gives each step's idle gap, split into
data wait, sync stall, launch-bound and other. Exact mode: a profiler window every
``trace_every_n_steps``, or when ``<run dir>/TRACE`` is touched.
Figures: ``idle/*``, and at the end one table for all ranks, ``idle.json`` and ``idle.png``.
Details: docs/GUIDE.md and docs/ARCHITECTURE.md, "Idle time".

Example::

    trainer = Trainer(callbacks=[IdleTimeMonitor()])
    trainer = Trainer(callbacks=[IdleTimeMonitor(trace_every_n_steps=500)])  # + exact windows
"""

from __future__ import annotations

import lightning.pytorch as pl

from gpu_busy.callbacks.measurement import Measurement
from gpu_busy.callbacks.ranks import (
    gather_objects,
    gather_rows,
    log_metrics,
    over_ranks,
    publish,
    run_dir,
)
from gpu_busy.callbacks.step_clock import StepClock
from gpu_busy.idle import IdleStats, ProfilerUnavailable, ProfilerWindows, StepSeries, StepTimer
from gpu_busy.idle.profiler_windows import torch_profiler
from gpu_busy.log import get_logger
from gpu_busy.report import idle as idle_report

log = get_logger(__name__)


class IdleTimeMonitor(Measurement):
    """Per-step GPU idle time with its causes, exact profiler windows, one report.

    Args:
        warmup_steps: first steps of the fit left out of every figure (start-up, autotuning).
        trace_every_n_steps: capture a profiler window every this many steps (0: only on
            demand).
        trace_steps: training steps per profiler window (after one warm-up step).
        sync_marks: on CUDA, time the host's syncs with CUDA's sync debug mode (free on
            steps without syncs) to tell sync stalls apart.
        picture: write ``idle.png`` (needs matplotlib).
        log_stats: write ``idle/*`` at Lightning's logging steps.
    """

    made_per_fit = ("_clock",)

    label, report_name = "idle time", "idle"

    def __init__(
        self,
        warmup_steps: int = 5,
        trace_every_n_steps: int = 0,
        trace_steps: int = 4,
        sync_marks: bool = True,
        picture: bool = True,
        log_stats: bool = True,
    ) -> None:
        if trace_every_n_steps < 0 or trace_steps < 1 or warmup_steps < 0:
            raise ValueError(
                "IdleTimeMonitor: trace_every_n_steps and warmup_steps must be >= 0 and "
                "trace_steps >= 1"
            )
        self.warmup_steps = warmup_steps
        self.trace_every_n_steps = trace_every_n_steps
        self.trace_steps = trace_steps
        self.use_sync_marks = sync_marks
        self.picture = picture
        self.log_stats = log_stats
        self.windows = ProfilerWindows(every_n_steps=trace_every_n_steps)  # set up per fit
        self.report: dict = {}
        self._clock: StepClock | None = None
        self._run_dir = None
        self.window = IdleStats()  # since the last logging step
        self.total = IdleStats()  # the whole fit after warm-up
        self.series = StepSeries()

    @property
    def timer(self) -> StepTimer | None:
        """The fit's step timer (``StepClock``'s, shared with ``ThroughputMonitor``)."""
        return self._clock.timer if self._clock is not None else None

    # -- set-up ---------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.window, self.total, self.series = IdleStats(), IdleStats(), StepSeries()
        self._clock = StepClock.subscribe(trainer, self, sync_marks=self.use_sync_marks)
        self._run_dir = run_dir(trainer)
        self.windows.set_up(
            folder=self._run_dir / "traces" if self._run_dir else None,
            trigger=self._run_dir / "TRACE" if self._run_dir else None,
            rank=trainer.global_rank,
            make_profiler=torch_profiler(self.trace_steps, cuda=self.timer.is_cuda),
        )

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit" and self._clock is not None:
            self.windows.stop(self.timer.steps_started)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._clock is not None:
            self.windows.stop(self.timer.steps_started)

    # -- what the step clock calls --------------------------------------------------------

    def step_ended(self, samples: int | None) -> None:
        try:
            if self.windows.after_step(self.timer.steps_started):
                self.timer.break_gap()  # the export runs in the next gap: not the GPU's idle
        except ProfilerUnavailable as err:
            log.warning("IdleTimeMonitor: profiler windows are off: %s", err)

    def take(self, timings) -> None:
        for t in timings:
            # Left out: start-up, and steps the profiler slowed down.
            if t.step < self.warmup_steps or self.windows.profiled(t.step):
                continue
            self.window.add_step(t)
            self.series.add(t)

    def window_row(self) -> list[float]:
        self.windows.look_for_trigger()  # a logging step: <run dir>/TRACE looked for here
        window = self.window.take()
        self.total.add(window)
        return window.as_list()

    def log_window(self, trainer: pl.Trainer, rows: list[list[float]]) -> None:
        if self.log_stats:
            cuda = self.timer.is_cuda
            stats = [IdleStats.from_list(r) for r in rows]
            metrics = over_ranks([s.means(cuda) for s in stats], prefix="idle/")
            # how many steps the means cover: fewer than log_every_n_steps marks a window
            # cut short (the first after warm-up or a resume)
            if steps := min(s.timed_steps for s in stats):
                metrics["idle/window_steps"] = steps
            log_metrics(trainer, metrics)

    # -- the end of fit ------------------------------------------------------------------

    def on_train_end(self, trainer, pl_module) -> None:
        if self._clock is None:
            return
        self.windows.stop(self.timer.steps_started)
        self._clock.finish()  # training is over: waiting costs nothing now
        self.total.add(self.window.take())

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._clock is None:
            return
        per_rank = [IdleStats.from_list(r) for r in gather_rows(trainer, self.total.as_list())]
        series = gather_objects(trainer, self.series.rows)
        traces = [t for ts in gather_objects(trainer, self.windows.results) for t in ts]
        if not trainer.is_global_zero:
            return
        self.report, lines = idle_report.end_of_fit(
            per_rank,
            series,
            cuda=self.timer.is_cuda,
            clock=self.timer.clock,
            traces=traces,
            warmup_steps=self.warmup_steps,
            trace_overhead_s=self.windows.seconds,
            folder=self._run_dir,
            picture=self.picture,
        )
        publish(trainer, "idle", self.report, lines, self._run_dir)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.teardown(trainer, pl_module, "")

    def teardown(self, trainer, pl_module, stage) -> None:
        self.windows.stop()
        if self._clock is not None:
            self._clock.remove(trainer)
