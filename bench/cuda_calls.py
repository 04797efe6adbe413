"""The CUDA route counted on the CPU: every CUDA runtime call the default callbacks make.

    python -m bench.host --cuda-route [--steps 200]

One fit of the default config's callbacks and plugin (``bench.host``'s near-free model, two
epochs with validation and saves) runs with ``gpu_busy.cuda_runtime``'s runtime replaced by
``CountingCuda``: the machinery takes its CUDA route on a CPU, and every call it makes of
CUDA (events, streams, the allocator's peaks) is counted by kind, by the callback whose hook
or routing layer made it, and by where the loop was: a steady training step, a logging step,
a save, or elsewhere in the fit. A *read* is a call that asks the device or the driver for
a result (an event's query, elapsed_time or synchronize, the allocator's statistics read or
reset); the rest only enqueue or switch. Per steady step, ``R`` must be 0 and ``N`` as low
as the figures allow (docs/ARCHITECTURE.md, "CUDA calls per step"; pinned by
tests/throughput/test_cuda_calls.py).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch

from gpu_busy.cuda_runtime import CudaRuntime
from gpu_busy.idle import StepTimer, TimedReads
from gpu_busy.prefetch import PrefetchIterator, StreamCopier

_CLOCK_EDGES = ("_StepEnd", "_StepStart")  # gpu_busy.callbacks.step_clock's two marks

# kind: whether it is a read (the device or the driver answers with a result)
KINDS = {
    "event record": False,
    "event query": True,
    "event elapsed_time": True,
    "event synchronize": True,
    "current_stream": False,
    "stream enter/exit": False,
    "device enter/exit": False,
    "wait_event": False,
    "wait_stream": False,
    "record_stream": False,
    "is_pinned": False,
    "memory statistics read": True,
    "memory statistics reset": True,
    "event create": False,
    "stream create": False,
}


class CountingCuda(CudaRuntime):
    """Answers the machinery as CUDA would, for any device, counting each call.

    ``where()`` says who is calling and when, as ``(row, bucket)``; each call adds one to
    ``counts[(row, bucket, kind)]``. Events complete when recorded and time on the host
    clock; the allocator's peaks are fixed numbers; tensors count as pinned (the template's
    DataLoader pins).
    """

    def __init__(self, where: Callable[[], tuple[str, str]]) -> None:
        self.where = where
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self.compute = _Stream(self)
        self.on_side_stream = False  # inside on_stream(): work goes to another stream

    def count(self, kind: str) -> None:
        row, bucket = self.where()
        self.counts[(row, bucket, kind)] += 1

    def takes_route(self, device: torch.device) -> bool:
        return True

    def event(self, timing: bool = False) -> _Event:
        self.count("event create")
        return _Event(self)

    def current_stream(self, device: torch.device) -> _Stream:
        self.count("current_stream")
        return self.compute

    def new_stream(self, device: torch.device) -> _Stream:
        self.count("stream create")
        return _Stream(self)

    @contextlib.contextmanager
    def on_stream(self, stream: Any) -> Iterator[None]:
        self.count("stream enter/exit")
        outer, self.on_side_stream = self.on_side_stream, stream is not self.compute
        try:
            yield
        finally:
            self.on_side_stream = outer
            self.count("stream enter/exit")

    @contextlib.contextmanager
    def on_device(self, device: torch.device) -> Iterator[None]:
        self.count("device enter/exit")
        try:
            yield
        finally:
            self.count("device enter/exit")

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        self.count("record_stream")

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        self.count("is_pinned")
        return True

    def memory_peaks(self, device: torch.device) -> tuple[int, int]:
        self.count("memory statistics read")
        return 2**30, 2**31

    def reset_memory_peaks(self, device: torch.device) -> None:
        self.count("memory statistics reset")


class _Event:
    __slots__ = ("cuda", "t")

    def __init__(self, cuda: CountingCuda) -> None:
        self.cuda, self.t = cuda, None

    def record(self, stream: Any = None) -> None:
        self.cuda.count("event record")
        self.t = time.perf_counter()

    def query(self) -> bool:
        self.cuda.count("event query")
        return self.t is not None

    def synchronize(self) -> None:
        self.cuda.count("event synchronize")

    def elapsed_time(self, end: _Event) -> float:
        self.cuda.count("event elapsed_time")
        return 1e3 * (end.t - self.t)


class _Stream:
    def __init__(self, cuda: CountingCuda) -> None:
        self.cuda = cuda

    def wait_event(self, event: Any) -> None:
        self.cuda.count("wait_event")

    def wait_stream(self, stream: Any) -> None:
        self.cuda.count("wait_stream")

    def synchronize(self) -> None:
        self.cuda.count("event synchronize")


def caller(names: dict[int, str]) -> str:
    """The callback whose code made the call: the innermost frame of a callback's method
    (the step clock's marks as "StepClock"; ``names`` by ``id``), or of the step timer's or
    the prefetcher's iterators, which the loop reads outside any hook."""
    frame = sys._getframe(2)
    while frame is not None:
        me = frame.f_locals.get("self")
        if isinstance(me, (StepTimer, TimedReads)):
            return "StepClock"
        if isinstance(me, pl.Callback):
            name = type(me).__name__
            return "StepClock" if name in _CLOCK_EDGES else names.get(id(me), name)
        if isinstance(me, (StreamCopier, PrefetchIterator)):
            return "StreamPrefetcher"
        frame = frame.f_back
    return "(Lightning)"


def per_step(counts: Counter, steps: dict[str, int], saves: int) -> dict:
    """``counts`` as calls per step of each kind: ``{bucket: {row: {kind: n per step}}}``,
    with each bucket's totals, ``calls`` and ``reads``."""
    divisors = {**steps, "save": saves, "fit": 1}
    out: dict[str, Any] = {}
    for (row, bucket, kind), n in sorted(counts.items()):
        per = n / divisors[bucket] if divisors.get(bucket) else None
        out.setdefault(bucket, {"rows": {}})["rows"].setdefault(row, {})[kind] = per
    for bucket in out.values():
        rows = bucket["rows"].values()
        bucket["calls"] = sum(v or 0.0 for r in rows for v in r.values())
        bucket["reads"] = sum(v or 0.0 for r in rows for k, v in r.items() if KINDS[k])
    return out


def table(result: dict) -> list[str]:
    """Per callback and kind, calls per steady step and per logging step; then N and R."""
    steady = result["per_step"].get("steady", {"rows": {}, "calls": 0.0, "reads": 0.0})
    logging_ = result["per_step"].get("logging", {"rows": {}, "calls": 0.0, "reads": 0.0})
    lines = [
        f"CUDA calls on the CUDA route, counted on the CPU ({result['steps']['steady']} steady "
        f"steps, {result['steps']['logging']} logging steps; * a read)",
        f"{'callback':<24}{'call':<26}{'per steady step':>16}{'per logging step':>18}",
    ]
    keys = sorted(
        {(r, k) for b in (steady, logging_) for r, kinds in b["rows"].items() for k in kinds}
    )
    for row, kind in keys:
        s = steady["rows"].get(row, {}).get(kind, 0.0)
        g = logging_["rows"].get(row, {}).get(kind, 0.0)
        star = "*" if KINDS[kind] else " "
        lines.append(f"{row:<24}{kind + star:<26}{s:>16.2f}{g:>18.2f}")
    lines += [
        f"CUDA calls per logging step: {_n(logging_['calls'])}; reads: {_n(logging_['reads'])}",
        f"CUDA calls per steady step: {_n(steady['calls'])}",
        f"CUDA reads per steady step: {_n(steady['reads'])}",
    ]
    return lines


def _n(x: float) -> str:
    return f"{x:.0f}" if abs(x - round(x)) < 0.005 else f"{x:.2f}"
