"""IdleTimeMonitor: how long the GPU sat idle in each training step, and why.

Always on: ``gpu_busy.idle.StepTimer`` times each step and the idle gap before it with
CUDA events read back without a sync, and splits the gap into data wait, sync stall,
launch-bound and other; the DataLoader wait is timed at the DataLoader, below any
prefetcher. Exact mode: every ``trace_every_n_steps`` steps, on ``request_trace()`` or
when ``<run dir>/TRACE`` is touched, a profiler window is saved to ``<run dir>/traces/``
and analysed (``gpu_busy.idle.ProfilerWindows``). Figures: ``idle/*`` at logging steps;
at the end of fit one table for all ranks, ``idle.json`` and ``idle.png``. On a CPU host
clocks stand in and the GPU-only figures read n/a. Details: docs/ARCHITECTURE.md, "Idle
time".

Example::

    trainer = Trainer(callbacks=[IdleTimeMonitor()])
    trainer = Trainer(callbacks=[IdleTimeMonitor(trace_every_n_steps=500)])  # + exact windows
"""

from __future__ import annotations

import lightning.pytorch as pl

from gpu_busy import batch_routing
from gpu_busy import lightning_compat as compat
from gpu_busy.callbacks.ranks import (
    gather_objects,
    gather_rows,
    log_metrics,
    over_ranks,
    publish,
    run_dir,
)
from gpu_busy.cuda_sync_warnings import debug_mode
from gpu_busy.idle import (
    IdleStats,
    ProfilerUnavailable,
    ProfilerWindows,
    StepSeries,
    StepTimer,
    SyncMarks,
    TimedReads,
)
from gpu_busy.idle.profiler_windows import torch_profiler
from gpu_busy.log import get_logger
from gpu_busy.report import idle as idle_report

log = get_logger(__name__)


class IdleTimeMonitor(compat.Callback):
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
        self.timer: StepTimer | None = None
        self.windows = ProfilerWindows(every_n_steps=trace_every_n_steps)  # set up per fit
        self.report: dict = {}
        # Position 0: next to the DataLoader, below a prefetcher, so only the host's own
        # wait for data is timed. Two monitors route the same loader apart.
        self._layer = batch_routing.Layer(f"idle-{id(self):x}", position=0)
        self._marks: SyncMarks | None = None
        self._run_dir = None
        self.window = IdleStats()  # since the last logging step
        self.total = IdleStats()  # the whole fit after warm-up
        self.series = StepSeries()
        self._edges: tuple[pl.Callback, ...] = ()  # the step's start and end marks

    def request_trace(self) -> None:
        """Capture a profiler window starting at the next step."""
        self.windows.request()

    # -- set-up ---------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.window, self.total, self.series = IdleStats(), IdleStats(), StepSeries()
        device = trainer.strategy.root_device
        if self.use_sync_marks and debug_mode().serves(device.type):
            self._marks = SyncMarks()  # open from a step's start to the next break
        self.timer = StepTimer(device, sync_marks=self._marks)
        self._bracket_steps(trainer)
        self._run_dir = run_dir(trainer)
        self.windows.set_up(
            folder=self._run_dir / "traces" if self._run_dir else None,
            trigger=self._run_dir / "TRACE" if self._run_dir else None,
            rank=trainer.global_rank,
            make_profiler=torch_profiler(self.trace_steps, cuda=self.timer.is_cuda),
        )
        self._route(trainer)

    def _bracket_steps(self, trainer: pl.Trainer) -> None:
        """Time the step itself, wherever this callback sits in the list: its start after
        every callback's ``on_train_batch_start``, its end before any callback's
        ``on_train_batch_end`` (their logging-step reads, checkpoint saves and collectives
        then fall between steps, where the GPU really waits for them), and a mark after the
        last one (the device work they enqueue is not idle)."""
        self._remove_edges(trainer)
        end, start = self._edges = (_StepEnd(self), _StepStart(self))
        # A new list, not an insert: Lightning is iterating the old one to call this hook.
        trainer.callbacks = [end, *trainer.callbacks, start]

    def _remove_edges(self, trainer: pl.Trainer) -> None:
        if self._edges:
            trainer.callbacks = [c for c in trainer.callbacks if c not in self._edges]
        self._edges = ()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._route(trainer)  # reload_dataloaders_every_n_epochs gives a new loader
        if self.timer is not None:
            self.timer.break_gap()

    def _route(self, trainer: pl.Trainer) -> None:
        timer = self.timer
        self._layer.route(trainer.fit_loop, lambda items: TimedReads(items, timer))

    # -- each step ------------------------------------------------------------------

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.timer is not None:
            self.timer.backward_begins()

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.timer is not None:
            self.timer.backward_ended()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.timer is None:
            return
        self._take(self.timer.poll())  # the step's end was marked first (_StepEnd)
        logging_now = compat.is_logging_step(trainer)
        if logging_now:
            self.windows.look_for_trigger()
        try:
            if self.windows.after_step(self.timer.steps_started):
                self.timer.break_gap()  # the export runs in the next gap: not the GPU's idle
        except ProfilerUnavailable as err:
            log.warning("IdleTimeMonitor: profiler windows are off: %s", err)
        if logging_now and self.log_stats:
            self._log_window(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit" and self.timer is not None:
            self.timer.break_gap()  # the next gap holds validation: not a step boundary
            self.windows.stop(self.timer.steps_started)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.timer is not None:
            self.timer.break_gap()
            self.windows.stop(self.timer.steps_started)

    def _open_marks(self) -> None:
        if self._marks is not None:
            self._marks.open()

    def _close_marks(self) -> None:
        """The debug mode is armed only where the marks are read: the training steps and
        the gaps between them, not validation or the epoch's end (their checkpoint saves)."""
        if self._marks is not None:
            self._marks.close()

    def _take(self, timings) -> None:
        for t in timings:
            # Left out: start-up, and steps the profiler slowed down.
            if t.step < self.warmup_steps or self.windows.profiled(t.step):
                continue
            self.window.add_step(t)
            self.series.add(t)

    def _log_window(self, trainer: pl.Trainer) -> None:
        window = self.window.take()
        self.total.add(window)
        rows = gather_rows(trainer, window.as_list())
        cuda = self.timer.is_cuda
        per_rank = [IdleStats.from_list(r).means(cuda) for r in rows]
        log_metrics(trainer, over_ranks(per_rank, prefix="idle/"))

    # -- the end of fit ------------------------------------------------------------------

    def on_train_end(self, trainer, pl_module) -> None:
        if self.timer is None:
            return
        self.windows.stop(self.timer.steps_started)
        self._take(self.timer.close())  # training is over: waiting costs nothing now
        self._close_marks()
        self.total.add(self.window.take())

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.timer is None:
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
        self._cleanup()
        self._remove_edges(trainer)

    def teardown(self, trainer, pl_module, stage) -> None:
        self._cleanup()
        self._remove_edges(trainer)

    def _cleanup(self) -> None:
        self.windows.stop()
        self._close_marks()
        self._layer.remove()


class _StepEnd(compat.Callback):
    """First in the callback list: marks the end of the training step, and closes the
    sync marks before any other callback's validation or epoch-end hook runs."""

    def __init__(self, monitor: IdleTimeMonitor) -> None:
        self.monitor = monitor

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.monitor.timer is not None:
            self.monitor.timer.end_step()

    def on_validation_start(self, trainer, pl_module) -> None:
        self.monitor._close_marks()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.monitor._close_marks()


class _StepStart(compat.Callback):
    """Last in the callback list: marks the start of the training step, and the point where
    every callback's ``on_train_batch_end`` has run (what they enqueued is not idle)."""

    def __init__(self, monitor: IdleTimeMonitor) -> None:
        self.monitor = monitor

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.monitor.timer is not None:
            self.monitor.timer.hooks_done()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.monitor.timer is not None:
            self.monitor._open_marks()
            self.monitor.timer.start_step()
