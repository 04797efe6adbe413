"""ThroughputMonitor: samples/s, FLOPs per batch, MFU and peak memory, without a sync.

Unlike Lightning's, which synchronises at every batch, the time comes from the fit's step
timer (``StepClock``); the FLOPs from PyTorch's counter around the first step, and again
at the step after a logging step where what trains changed (``WhatTrains``: parameters
unfrozen, a module switched to eval, the batch's shapes), or ``flops_per_batch=``; the
peak from the datasheets' table (or ``peak_tflops=``), memory from the allocator's
counters, read once per logging window. Figures: ``throughput/*`` and
``throughput.json``. Details: docs/GUIDE.md, "Throughput, MFU and memory".

Example::

    trainer = Trainer(callbacks=[ThroughputMonitor()])
    trainer = Trainer(callbacks=[ThroughputMonitor(flops_per_batch=6 * n_params * tokens,
                                                   peak_tflops=312)])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

import lightning.pytorch as pl
import torch

from gpu_busy.callbacks.measurement import Measurement
from gpu_busy.callbacks.ranks import gather_rows, log_metrics, over_ranks, publish, run_dir
from gpu_busy.callbacks.step_clock import StepClock
from gpu_busy.log import get_logger
from gpu_busy.patches import patch, signature_kept
from gpu_busy.report import throughput as throughput_report
from gpu_busy.report.throughput import Flops
from gpu_busy.throughput import (
    FlopCount,
    FlopCounts,
    MemoryPeaks,
    MemoryStats,
    ThroughputStats,
    WhatTrains,
    peak_flops,
)

log = get_logger(__name__)


class ThroughputMonitor(Measurement):
    """Throughput per rank and in total, MFU and peak memory, measured without a sync.

    Args:
        warmup_steps: first steps of the fit left out of the throughput (start-up).
        flops_per_batch: forward + backward FLOPs of one batch, if you know them; None
            counts them on the fit's first batch, and again where what trains changes.
        peak_tflops: the device's peak TFLOP/s for the run's precision, for a device the
            table lacks (or to override it).
        tokens: how many tokens a batch holds, as a Python int (a device tensor would have
            to be read back); by default a batch's ``num_tokens`` key or attribute.
    """

    label, report_name = "throughput", "throughput"

    def __init__(
        self,
        warmup_steps: int = 5,
        flops_per_batch: float | None = None,
        peak_tflops: float | None = None,
        tokens: Callable[[Any], int | None] | None = None,
    ) -> None:
        if warmup_steps < 0 or any(
            v is not None and v <= 0 for v in (flops_per_batch, peak_tflops)
        ):
            raise ValueError(
                "ThroughputMonitor: warmup_steps must be >= 0, flops_per_batch and peak_tflops "
                "above 0"
            )
        self.warmup_steps = warmup_steps
        self.flops_per_batch = flops_per_batch
        self.peak_tflops = peak_tflops
        self.tokens = tokens or _num_tokens
        self.report: dict = {}
        self._clock: StepClock | None = None
        self._memory: MemoryPeaks | None = None
        self._count: FlopCount | None = None  # the count in progress
        self._counts: FlopCounts | None = None  # every count of the fit
        self._module: pl.LightningModule | None = None
        self._counting: tuple[str, WhatTrains | None] = ("", None)  # why, and its state
        self._wrapped: list[Callable[[], None]] = []  # the undos of the counted hooks
        self._window = ThroughputStats()  # since the last logging step
        self._total = ThroughputStats()  # read back over the fit
        self._window_rates: list[float] = []  # samples/s of each window, over ranks
        self._run_dir = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._memory = MemoryPeaks(trainer.strategy.root_device)
        self._window, self._total = ThroughputStats(), ThroughputStats()
        self._window_rates = []
        self._counts = FlopCounts() if self.flops_per_batch is None else None
        self._module = pl_module
        self._run_dir = run_dir(trainer)
        self._clock = StepClock.subscribe(trainer, self)
        self._memory.start()
        if self._counts is not None:
            self._wrap(pl_module, "the fit's first step")  # counted, then unwrapped

    # -- what the step clock calls --------------------------------------------------------

    def step_ended(self, samples: int | None) -> None:
        if not self._wrapped or self._count.calls == 0:
            return  # not counting, or the step ran no training_step: the next one counts
        self._unwrap()
        count, (why, trains) = self._count, self._counting
        step = self._clock.timer.steps_started - 1
        self._counts.counted(step, count.flops, samples, trains, why, count.error)
        if count.error:
            log.warning(
                "ThroughputMonitor: FLOPs of step %d not counted, MFU n/a (%s); training goes "
                "on; give flops_per_batch= to have them",
                step,
                count.error,
            )

    def take(self, timings) -> None:
        counts = self._counts
        for t in timings:
            if t.step < max(1, self.warmup_steps) or (counts and t.step in counts.counted_steps):
                continue  # start-up, or a step slowed by the counter
            flops = self.flops_per_batch if counts is None else counts.of_step(t.step, t.samples)
            self._window.add_step(t, flops)

    def window_row(self) -> list[float]:
        window = self._window.take()
        self._total.add(window)
        if self._counts is not None and not self._wrapped:
            trains = WhatTrains.of(self._module, self._clock.window_batch)
            why = self._counts.check(trains, next_step=self._clock.timer.steps_started)
            if why:
                self._wrap(self._module, why)  # the next step, counted
        return window.as_list() + self._memory.take_window().as_list()

    def log_window(self, trainer: pl.Trainer, rows: list[list[float]]) -> None:
        n = len(fields(ThroughputStats))
        stats = [ThroughputStats.from_list(r[:n]) for r in rows]
        per_rank = [
            {**s.rates(), **MemoryStats.from_list(r[n:]).gib()}
            for s, r in zip(stats, rows, strict=True)
        ]
        metrics = over_ranks(per_rank, prefix="throughput/")
        rates = [r["samples_per_s"] for r in per_rank]
        if rates and None not in rates:  # make compare's noise: each window's rate
            self._window_rates.append(sum(rates))
        if steps := min(s.steps for s in stats):  # as idle/window_steps
            metrics["throughput/window_steps"] = steps
        log_metrics(trainer, metrics)

    # Validation's memory is not a training step's: left out of the peaks
    def on_validation_start(self, trainer, pl_module) -> None:
        if self._memory is not None and trainer.state.fn == "fit":
            self._memory.pause()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._memory is not None and trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._memory.start()

    def on_train_end(self, trainer, pl_module) -> None:
        if self._memory is not None:
            self._memory.pause()
        if self._clock is not None:
            self._clock.finish()  # training is over: waiting costs nothing now

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._clock is None or self._memory is None:
            return
        self._total.add(self._window.take())
        self._memory.take_window()
        rows = gather_rows(trainer, self._total.as_list() + self._memory.total.as_list())
        if not trainer.is_global_zero:
            return
        n = len(self._total.as_list())
        device = trainer.strategy.root_device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        precision = _compute_precision(trainer) if device.type == "cuda" else None
        self.report, lines = throughput_report.end_of_fit(
            [ThroughputStats.from_list(r[:n]) for r in rows],
            [MemoryStats.from_list(r[n:]) for r in rows],
            flops=self._flops(),
            peak=peak_flops(name, precision, self.peak_tflops),
            device=name,
            precision=precision,
            clock=self._clock.timer.clock,
            warmup_steps=self.warmup_steps,
            samples_counted=self._clock.samples_counted,
            samples_note=self._clock.samples_note,
            window_rates=self._window_rates,
        )
        publish(trainer, "throughput", self.report, lines, self._run_dir)

    def _flops(self) -> Flops:
        if self.flops_per_batch is not None:
            return Flops(self.flops_per_batch, None, "given (flops_per_batch=)")
        if self._counts is None or not self._counts.segments:
            return Flops(None, None, "no training step ran")
        segments = self._counts.covered(last_step=self._clock.timer.steps_started - 1)
        first, last = self._counts.segments[0], self._counts.segments[-1]
        if len(segments) == 1 and first.error:
            return Flops(None, None, f"not counted ({first.error}); give flops_per_batch=",
                         segments)  # fmt: skip
        if len(segments) == 1 and first.per_batch is None:
            return Flops(
                None,
                None,
                "FlopCounterMode saw no matmul, convolution or attention in the first step; "
                "give flops_per_batch=",
                segments,
            )
        if len(segments) == 1:
            of = f"a batch of {first.samples}" if first.samples else "a batch"
            how = f"FlopCounterMode, forward and backward of {of} at step {first.step}"
            return Flops(first.per_batch, first.samples, how, segments)
        parts = [
            f"{_figure(s['flops_per_batch'])} at steps {s['first']}-{s['last']} ({s['why']})"
            for s in segments
        ]
        how = "FlopCounterMode, counted again where what trains changed: " + "; ".join(parts)
        return Flops(last.per_batch, last.samples, how, segments)

    # -- counting a step ------------------------------------------------------------------

    def _wrap(self, pl_module: pl.LightningModule, why: str) -> None:
        """The module's own step and backward run inside a new counter (an instance
        attribute over the method, removed after the step); the step's batch says what
        trains (``WhatTrains``) as it begins."""
        self._count = count = FlopCount()
        self._counting = (why, None)
        step = pl_module.training_step

        def training_step(*args: Any, **kwargs: Any) -> Any:
            batch = args[0] if args else kwargs.get("batch")
            self._counting = (why, WhatTrains.of(pl_module, batch))
            return step(*args, **kwargs)

        backward = pl_module.backward
        self._wrapped = [  # Lightning reads the step's signature to choose its arguments
            patch(pl_module, "training_step", signature_kept(step, count.around(training_step))),
            patch(pl_module, "backward", signature_kept(backward, count.around(backward))),
        ]

    def _unwrap(self) -> None:
        for undo in self._wrapped:
            undo()
        self._wrapped = []

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.teardown(trainer, pl_module, "")

    def teardown(self, trainer, pl_module, stage) -> None:
        self._unwrap()
        if self._clock is not None:
            self._clock.remove(trainer)
            self._clock = None


def _figure(flops: float | None) -> str:
    return "n/a" if flops is None else f"{flops:.3g}"


def _num_tokens(batch: Any) -> int | None:
    """A batch's ``num_tokens`` (a key or an attribute), where it is a Python int."""
    value = batch.get("num_tokens") if isinstance(batch, dict) else None
    value = getattr(batch, "num_tokens", value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _compute_precision(trainer: pl.Trainer) -> str | None:
    """The peak table's column for Lightning's precision setting. At 32 bits TF32 is
    counted when matmuls or cuDNN may use it (cuDNN's convolutions do by default): the
    lower MFU of the two, never above what the device did."""
    precision = str(trainer.precision)
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    if precision.startswith("32"):
        tf32 = torch.get_float32_matmul_precision() != "highest" or torch.backends.cudnn.allow_tf32
        return "tf32" if tf32 else "fp32"
    return None
