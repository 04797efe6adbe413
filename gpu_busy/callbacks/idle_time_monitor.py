"""IdleTimeMonitor: how long the GPU sat idle in each training step, and why.

Always on: ``gpu_busy.idle.StepTimer`` records CUDA events at each step's start and
end and when the step's batch arrived from the DataLoader, reads them back a step or two
later with ``query()`` (never a sync), and splits the idle gap before each step into
data wait, sync stall, launch-bound and other (definitions: docs/ARCHITECTURE.md, "Idle
time"). The DataLoader wait is timed at the DataLoader itself, below any prefetcher.

Exact mode: every ``trace_every_n_steps`` steps (0: never), and on demand (``request_trace()``
or by touching a file named ``TRACE`` in the run directory), a ``torch.profiler`` window
of ``trace_steps`` steps is saved to ``<run dir>/traces/`` (open it in Perfetto or
TensorBoard) and analysed with ``gpu_busy.idle.analyze_trace``.

Figures. At Lightning's logging steps, ``idle/*`` per step: idle share, idle ms by cause,
device ms, transfer ms, the host's DataLoader wait; each the mean over ranks and, with
``_slowest_rank``, the worst rank's (so a straggler shows). All ranks reduce; rank zero
writes. At the end of fit rank zero prints one table for all ranks (with the
prefetcher's and the sync detector's figures when those callbacks are on) and writes
``idle.json`` (for CI thresholds) and ``idle.png`` (the per-step breakdown) to the run
directory.

Example::

    trainer = Trainer(callbacks=[IdleTimeMonitor()])
    trainer = Trainer(callbacks=[IdleTimeMonitor(trace_every_n_steps=500)])  # + exact windows

On a CPU the same code runs on host clocks: idle is the time between steps; the figures
only a GPU queue gives (sync stall, launch-bound, syncs) read n/a.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from gpu_busy import batch_routing
from gpu_busy import lightning_compat as compat
from gpu_busy.callbacks.stream_prefetcher import StreamPrefetcher
from gpu_busy.callbacks.sync_point_detector import SyncPointDetector
from gpu_busy.idle import (
    IdleStats,
    StepSeries,
    StepTimer,
    SyncMarks,
    TimedReads,
    analyze_trace,
    build_report,
    render_table,
    save_picture,
)
from gpu_busy.log import get_logger

log = get_logger(__name__)

_SLOWEST = ("idle_pct", "idle_ms", "device_ms", "host_data_wait_ms")


class IdleTimeMonitor(pl.Callback):
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
        self.report: dict = {}
        self._layer = f"idle-{id(self):x}"  # two monitors route the same loader apart
        self._marks: SyncMarks | None = None
        self._profiler = None
        self._trace_requested = False
        self._trace_done = False
        self._reset()

    def _reset(self) -> None:
        self.window = IdleStats()  # since the last logging step
        self.total = IdleStats()  # the whole fit after warm-up
        self.series = StepSeries()
        self.traces: list[dict] = []
        self._run_dir: Path | None = None
        self._trigger_mtime: float | None = None
        self._trace_first = 0
        self._trace_seconds = 0.0
        self._profiled: list[list[int]] = []  # [first, last] steps under the profiler
        self._loaders: list = []

    def request_trace(self) -> None:
        """Capture a profiler window starting at the next step."""
        self._trace_requested = True

    # -- set-up ---------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        device = trainer.strategy.root_device
        if self.use_sync_marks and device.type == "cuda":
            self._marks = SyncMarks().open()
        self.timer = StepTimer(device, sync_marks=self._marks)
        # trainer.log_dir is a broadcast under DDP: every rank asks, at the same point.
        log_dir = trainer.log_dir if trainer.loggers else None
        self._run_dir = Path(log_dir) if log_dir else None
        self._trigger_mtime = self._trigger_time()
        self._route(trainer)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._route(trainer)  # reload_dataloaders_every_n_epochs gives a new loader
        if self.timer is not None:
            self.timer.break_gap()

    def _route(self, trainer: pl.Trainer) -> None:
        timer = self.timer
        # Position 0: next to the DataLoader, below a prefetcher, so only the host's own
        # wait for data is timed.
        loader = batch_routing.route_batches(
            trainer.fit_loop, lambda items: TimedReads(items, timer), layer=self._layer, position=0
        )
        if loader is not None and loader not in self._loaders:
            self._loaders.append(loader)

    # -- each step ------------------------------------------------------------------

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.timer is not None:
            self.timer.start_step()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.timer is None:
            return
        self.timer.end_step()
        self._take(self.timer.poll())
        logging_now = compat.is_logging_step(trainer)
        self._advance_trace(trainer, logging_now)
        if logging_now and self.log_stats:
            self._log_window(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit" and self.timer is not None:
            self.timer.break_gap()  # the next gap holds validation: not a step boundary
            self._stop_trace(keep=False)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.timer is not None:
            self.timer.break_gap()
        self._stop_trace(keep=False)

    def _take(self, timings) -> None:
        for t in timings:
            # Left out: start-up, and steps the profiler slowed down.
            if t.step < self.warmup_steps or any(a <= t.step <= b for a, b in self._profiled):
                continue
            self.window.add_step(t)
            self.series.add(t)

    # -- logging steps --------------------------------------------------------------

    def _log_window(self, trainer: pl.Trainer) -> None:
        window = self.window.take()
        self.total.add(window)
        rows = _gather(trainer, window.as_list())
        if not (trainer.is_global_zero and trainer.loggers) or not rows:
            return
        cuda = self.timer.is_cuda
        per_rank = [IdleStats.from_list(r) for r in rows]
        total = IdleStats()
        for s in per_rank:
            total.add(s)
        metrics = {f"idle/{k}": v for k, v in total.means(cuda).items() if v is not None}
        if len(per_rank) > 1:
            for key in _SLOWEST:
                values = [s.means(cuda)[key] for s in per_rank]
                values = [v for v in values if v is not None]
                if values:
                    metrics[f"idle/{key}_slowest_rank"] = max(values)
        if metrics:
            metrics["epoch"] = trainer.current_epoch  # as Lightning's own rows carry it
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=compat.logger_step(trainer))

    # -- exact mode: profiler windows -------------------------------------------------

    def _advance_trace(self, trainer: pl.Trainer, logging_now: bool) -> None:
        if self._profiler is not None:
            self._profiler.step()  # calls _trace_ready once the window's steps are done
            if self._trace_done:
                self._stop_trace(keep=True)
            return
        if logging_now:
            mtime = self._trigger_time()
            if mtime is not None and mtime != self._trigger_mtime:
                self._trigger_mtime = mtime
                self._trace_requested = True
        every = self.trace_every_n_steps
        ended = self.timer.next_step  # steps ended in this fit: start_step, end_step paired
        if self._trace_requested or (every and ended % every == 0):
            self._trace_requested = False
            self._start_trace(trainer)

    def _start_trace(self, trainer: pl.Trainer) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU]
        if self.timer is not None and self.timer.is_cuda:
            activities.append(ProfilerActivity.CUDA)
        self._trace_first = self.timer.next_step + 1  # the window's first step after warm-up
        self._trace_done = False
        rank = trainer.global_rank
        t0 = time.perf_counter()
        try:
            self._profiler = profile(
                activities=activities,
                schedule=schedule(wait=0, warmup=1, active=self.trace_steps, repeat=1),
                on_trace_ready=lambda prof: self._trace_ready(prof, rank),
            )
            self._profiler.start()
        except RuntimeError as err:  # e.g. CUPTI missing or held by another profiler
            self._profiler = None
            self.trace_every_n_steps = 0
            log.warning("IdleTimeMonitor: profiler windows are off: %s", err)
            return
        self._profiled.append([self.timer.next_step, 1 << 62])
        self._trace_seconds += time.perf_counter() - t0

    def _trace_ready(self, prof, rank: int) -> None:
        t0 = time.perf_counter()
        name = f"rank{rank}-step{self._trace_first}.pt.trace.json"
        keep = self._run_dir is not None
        folder = self._run_dir / "traces" if keep else Path(tempfile.mkdtemp(prefix="idle-"))
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        prof.export_chrome_trace(str(path))
        result = analyze_trace(path).as_dict()
        result.pop("steps")
        result.update(path=str(path) if keep else None, first_step=self._trace_first, rank=rank)
        if not keep:
            path.unlink(missing_ok=True)
            folder.rmdir()
        self.traces.append(result)
        self._trace_seconds += time.perf_counter() - t0
        # Stopped once step() returns: the profiler is still inside it here.
        self._trace_done = True

    def _stop_trace(self, keep: bool) -> None:
        prof, self._profiler = self._profiler, None
        if prof is None:
            return
        t0 = time.perf_counter()
        if not keep:
            prof.on_trace_ready = None  # an interrupted window is not saved
        prof.stop()
        if self.timer is not None:
            self._profiled[-1][1] = self.timer.next_step - 1
            self.timer.break_gap()  # the export ran in the next gap: not the GPU's idle
        self._trace_seconds += time.perf_counter() - t0

    def _trigger_time(self) -> float | None:
        if self._run_dir is None:
            return None
        try:
            return (self._run_dir / "TRACE").stat().st_mtime
        except OSError:
            return None

    # -- the end of fit ------------------------------------------------------------------

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop_trace(keep=False)
        if self.timer is not None:
            self._take(self.timer.close())  # training is over: waiting costs nothing now
        if self._marks is not None:
            self._marks.close()
        self.total.add(self.window.take())

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.timer is None:
            return
        per_rank = [IdleStats.from_list(r) for r in _gather(trainer, self.total.as_list())]
        series = _gather_objects(trainer, self.series.rows)
        traces = [t for ts in _gather_objects(trainer, self.traces) for t in ts]
        prefetch = _find(trainer, StreamPrefetcher)
        prefetch_rows = _gather_objects(trainer, prefetch.summary() if prefetch else None)
        if not trainer.is_global_zero:
            return
        detector = _find(trainer, SyncPointDetector)
        self.report = build_report(
            per_rank,
            cuda=self.timer.is_cuda,
            clock=self.timer.clock,
            prefetch=_mean_dicts(prefetch_rows) if prefetch and prefetch.enabled else None,
            syncs=detector.summary() if detector is not None else None,
            traces=traces,
        )
        self.report["trace_overhead_s"] = self._trace_seconds
        for line in render_table(self.report):
            log.info("%s", line)
        if self._run_dir is None:
            return
        self._run_dir.mkdir(parents=True, exist_ok=True)
        json_path = self._run_dir / "idle.json"
        picture = None
        if self.picture:
            picture = save_picture(
                dict(enumerate(series)),
                self._run_dir / "idle.png",
                title=f"per-step time, mean over {trainer.world_size} rank(s) ({self.timer.clock})",
            )
        self.report["picture"] = str(picture) if picture else None
        json_path.write_text(json.dumps(self.report, indent=1))
        log.info(
            "idle report: %s%s", json_path, f", picture {picture}" if picture else " (no picture)"
        )

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._cleanup()

    def teardown(self, trainer, pl_module, stage) -> None:
        self._cleanup()

    def _cleanup(self) -> None:
        self._stop_trace(keep=False)
        if self._marks is not None:
            self._marks.close()
        for loader in self._loaders:
            batch_routing.unroute(loader, layer=self._layer)
        self._loaders.clear()


def _gather(trainer: pl.Trainer, row: list[float]) -> list[list[float]]:
    if trainer.world_size == 1:
        return [row]
    t = torch.tensor(row, dtype=torch.float64, device=trainer.strategy.root_device)
    return trainer.strategy.all_gather(t).reshape(trainer.world_size, -1).cpu().tolist()


def _gather_objects(trainer: pl.Trainer, obj) -> list:
    if trainer.world_size == 1 or not torch.distributed.is_initialized():
        return [obj]
    out: list = [None] * trainer.world_size
    torch.distributed.all_gather_object(out, obj)
    return out


def _find(trainer: pl.Trainer, kind: type):
    return next((c for c in trainer.callbacks if isinstance(c, kind)), None)


def _mean_dicts(rows: list[dict | None]) -> dict:
    """Key by key, the mean of the ranks' values that are not None (sums for counts)."""
    rows = [r for r in rows if r]
    out: dict = {}
    for key in rows[0] if rows else []:
        values = [r[key] for r in rows if r.get(key) is not None]
        if not values:
            out[key] = None
        elif key in ("steps", "pageable_batches"):
            out[key] = sum(values)
        else:
            out[key] = sum(values) / len(values)
    return out
