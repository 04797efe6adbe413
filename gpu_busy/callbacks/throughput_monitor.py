"""ThroughputMonitor: samples/s, FLOPs per batch, MFU and peak memory, without a sync.

Unlike Lightning's, which synchronises at every batch, the time comes from the fit's step
timer (``StepClock``); the FLOPs from PyTorch's counter around the first step (or
``flops_per_batch=``), the peak from the datasheets' table (or ``peak_tflops=``), memory
from the allocator's counters, read once per logging window. Figures: ``throughput/*`` and
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
from gpu_busy.patches import patch
from gpu_busy.report import throughput as throughput_report
from gpu_busy.report.throughput import Flops
from gpu_busy.throughput import (
    FlopCount,
    MemoryPeaks,
    MemoryStats,
    ThroughputStats,
    peak_flops,
)

log = get_logger(__name__)

# What a LightningModule runs for one batch; the wrappers count what runs inside them.
_COUNTED_HOOKS = ("training_step", "backward")


class ThroughputMonitor(Measurement):
    """Throughput per rank and in total, MFU and peak memory, measured without a sync.

    Args:
        warmup_steps: first steps of the fit left out of the throughput (start-up).
        flops_per_batch: forward + backward FLOPs of one batch, if you know them; None
            counts them on the fit's first batch.
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
        self._count: FlopCount | None = None
        self._counted_samples: int | None = None
        self._wrapped: list[Callable[[], None]] = []  # the undos of the counted hooks
        self._window = ThroughputStats()  # since the last logging step
        self._total = ThroughputStats()  # read back over the fit
        self._window_rates: list[float] = []  # samples/s of each window, over ranks
        self._run_dir = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._memory = MemoryPeaks(trainer.strategy.root_device)
        self._window, self._total = ThroughputStats(), ThroughputStats()
        self._window_rates = []
        self._count = FlopCount() if self.flops_per_batch is None else None
        self._counted_samples = None
        self._run_dir = run_dir(trainer)
        self._clock = StepClock.subscribe(trainer, self)
        self._memory.start()
        if self._count is not None:
            self._wrap(pl_module)  # the fit's first step, counted, then unwrapped

    # -- what the step clock calls --------------------------------------------------------

    def step_ended(self, samples: int | None) -> None:
        if self._wrapped:
            self._unwrap()
            self._counted_samples = samples
            if self._count is not None and self._count.error:
                log.warning(
                    "ThroughputMonitor: FLOPs not counted, MFU n/a (%s); training goes on; "
                    "give flops_per_batch= to have them",
                    self._count.error,
                )

    def take(self, timings) -> None:
        for t in timings:
            if t.step >= max(1, self.warmup_steps):  # not start-up, nor the counted step
                self._window.add_step(t)

    def window_row(self) -> list[float]:
        window = self._window.take()
        self._total.add(window)
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
            window_rates=self._window_rates,
        )
        publish(trainer, "throughput", self.report, lines, self._run_dir)

    def _flops(self) -> Flops:
        if self.flops_per_batch is not None:
            return Flops(self.flops_per_batch, None, "given (flops_per_batch=)")
        if self._count is None or self._count.calls == 0:
            return Flops(None, None, "no training step ran")
        if self._count.error:
            return Flops(None, None, f"not counted ({self._count.error}); give flops_per_batch=")
        if self._count.flops is None:
            return Flops(
                None,
                None,
                "FlopCounterMode saw no matmul, convolution or attention in the first step; "
                "give flops_per_batch=",
            )
        size = self._counted_samples
        of = f"a batch of {size}" if size else "a batch"
        return Flops(
            self._count.flops, size, f"FlopCounterMode, forward and backward of {of} at step 0"
        )

    # -- counting the first step ----------------------------------------------------------

    def _wrap(self, pl_module: pl.LightningModule) -> None:
        """The module's own step and backward run inside the counter (an instance attribute
        over the method, removed after the step)."""
        self._wrapped = [
            patch(pl_module, hook, self._count.around(getattr(pl_module, hook)))
            for hook in _COUNTED_HOOKS
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
