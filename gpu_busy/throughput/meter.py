"""Samples per second from the device's own clock: sums over the steps the step timer read.

A step's period runs from the previous step's end to its own on the compute stream
(``gpu_busy.idle.StepTimer``), with no sync; a step with no step before it (after
validation, at an epoch's start) or left untimed is left out. Off CUDA host clocks stand in.

Example::

    window = ThroughputStats()
    for timing in timer.poll():           # StepTiming, with the batch's samples
        window.add_step(timing)
    window.rates()["samples_per_s"]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpu_busy.window_sums import WindowSums


@dataclass
class ThroughputStats(WindowSums):
    steps: int = 0  # steps with a whole period timed
    device_ms: float = 0.0  # their periods on the device clock
    samples: int = 0
    tokens: int = 0
    unsized_steps: int = 0  # steps whose batch had no size Lightning could find
    untokened_steps: int = 0  # steps whose batch did not say how many tokens it held
    untimed_steps: int = 0  # steps lost because the event pool ran dry
    flops: float = 0.0  # the timed steps' FLOPs, each by the count that covers it
    flopless_steps: int = 0  # timed steps whose FLOPs are unknown

    def add_step(self, t: Any, flops: float | None = None) -> None:
        """One ``StepTiming``: its period, where it has one, with its batch's counts and
        ``flops`` (``FlopCounts.of_step``; None: unknown)."""
        if t.period_ms is None:
            self.untimed_steps += t.device_ms is None  # the event pool ran dry
            return
        self.steps += 1
        self.device_ms += t.period_ms
        self.samples += t.samples or 0
        self.unsized_steps += t.samples is None
        self.tokens += t.tokens or 0
        self.untokened_steps += t.tokens is None
        self.flops += flops or 0.0
        self.flopless_steps += flops is None

    def flops_per_s(self) -> float | None:
        """FLOP/s over the timed steps, where every one's FLOPs are known."""
        seconds = self.device_ms / 1e3
        if not self.steps or seconds <= 0 or self.flopless_steps or self.flops <= 0:
            return None
        return self.flops / seconds

    def rates(self) -> dict[str, float | None]:
        """samples/s, tokens/s and steps/s over the timed steps; None where unknown."""
        seconds = self.device_ms / 1e3
        if not self.steps or seconds <= 0:
            return {"samples_per_s": None, "tokens_per_s": None, "steps_per_s": None}
        return {
            "samples_per_s": None if self.unsized_steps else self.samples / seconds,
            "tokens_per_s": None if self.untokened_steps else self.tokens / seconds,
            "steps_per_s": self.steps / seconds,
        }
