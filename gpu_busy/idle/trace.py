"""Exact GPU idle time from a profiler trace: what the step-boundary events cannot see.

``analyze_trace`` reads a ``torch.profiler`` Chrome trace (a path, gzipped or not, or the
loaded dict): span, busy and idle time of every kernel, memcpy and memset, for the whole
trace and per ``ProfilerStep#N``, NCCL apart, and each host wait split by the step
timer's causes. Details: docs/ARCHITECTURE.md, "Idle time".

Example::

    result = analyze_trace("runs/default/version_0/traces/rank0-step100.pt.trace.json")
    print(result.span_ms, result.busy_ms, result.idle_ms, result.causes)
    for step in result.steps:
        print(step.name, step.idle_ms, step.gap_before_ms)
"""

from __future__ import annotations

import bisect
import gzip
import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpu_busy.idle.causes import names, split_gap
from gpu_busy.idle.intervals import Interval, gaps, merge, overlap_length

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
# Host calls that block until the GPU has caught up.
SYNC_CALLS = frozenset(
    {
        "cudaDeviceSynchronize",
        "cudaStreamSynchronize",
        "cudaEventSynchronize",
        "cudaMemcpy",
        "cudaMemcpy2D",
        "cuCtxSynchronize",
        "cuStreamSynchronize",
        "cuEventSynchronize",
    }
)
_STEP_PREFIX = "ProfilerStep#"
_TOLERANCE_US = 5.0  # host and device timestamps of one trace agree to a few µs


@dataclass
class StepIdle:
    """One profiler step. ``gap_before_ms``: idle from the previous step's last device
    work to this step's first (None for the first step)."""

    name: str
    span_ms: float
    busy_ms: float
    idle_ms: float
    gap_before_ms: float | None
    device_events: int
    causes: dict[str, float] = field(default_factory=dict)  # idle + gap_before, by cause


@dataclass
class TraceIdle:
    span_ms: float
    busy_ms: float
    idle_ms: float
    compute_ms: float  # union of kernels other than NCCL's
    memcpy_ms: float
    memset_ms: float
    nccl_ms: float
    idle_without_nccl_ms: float
    host_wait_ms: float  # the gaps where the GPU waited for the host (HTA's definition)
    causes: dict[str, float]  # all of idle_ms, by cause
    device_events: int
    streams: int
    steps: list[StepIdle] = field(default_factory=list)

    @property
    def idle_pct(self) -> float | None:
        return 100.0 * self.idle_ms / self.span_ms if self.span_ms > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "idle_pct": self.idle_pct}


@dataclass
class _DeviceEvent:
    start: float
    end: float
    category: str
    nccl: bool
    launch: float | None  # host time of the launching runtime call
    launch_tid: Any = None


def load_trace(trace: str | Path | dict | list) -> list[dict]:
    """The event list of a Chrome trace given as a path (``.json`` or ``.json.gz``) or data."""
    if isinstance(trace, (str, Path)):
        path = Path(trace)
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            trace = json.load(f)
    if isinstance(trace, dict):
        trace = trace.get("traceEvents", [])
    if not isinstance(trace, list):
        raise ValueError("a Chrome trace is a JSON object with 'traceEvents' or a list of events")
    return trace


def analyze_trace(trace: str | Path | dict | list) -> TraceIdle:
    """Span, busy and idle time of the device activity in a profiler trace (see module doc)."""
    events = [e for e in load_trace(trace) if e.get("ph") == "X" and "dur" in e]
    host = _HostView(events)
    on_device = [e for e in events if _category(e) in DEVICE_CATEGORIES]
    device = [_device_event(e, host) for e in on_device]
    busy_merged = merge((d.start, d.end) for d in device)
    span = busy_merged[-1][1] - busy_merged[0][0] if busy_merged else 0.0
    busy = sum(e - s for s, e in busy_merged)
    causes, host_wait = _classify(gaps(busy_merged), device, host)
    return TraceIdle(
        span_ms=_ms(span),
        busy_ms=_ms(busy),
        idle_ms=_ms(span - busy),
        **{kind: _ms(_busy_us(filter(which, device))) for kind, which in _KINDS.items()},
        idle_without_nccl_ms=_ms(span - _busy_us(d for d in device if not d.nccl)),
        host_wait_ms=_ms(host_wait),
        causes={c: _ms(v) for c, v in causes.items()},
        device_events=len(device),
        streams=len({(e.get("pid"), e.get("tid")) for e in on_device}),
        steps=_per_step(device, host),
    )


# The device time of each kind, as the events that make it.
_KINDS = {
    "compute_ms": lambda d: d.category == "kernel" and not d.nccl,
    "memcpy_ms": lambda d: d.category == "gpu_memcpy",
    "memset_ms": lambda d: d.category == "gpu_memset",
    "nccl_ms": lambda d: d.nccl,
}


def _busy_us(events: Iterable[_DeviceEvent]) -> float:
    """How long at least one of ``events`` ran (µs)."""
    return sum(e - s for s, e in merge((d.start, d.end) for d in events))


def _category(event: dict) -> str:
    return str(event.get("cat", "")).lower()


def _device_event(e: dict, host: _HostView) -> _DeviceEvent:
    cat, start = _category(e), float(e["ts"])
    launch = host.launches.get(_correlation(e))
    return _DeviceEvent(
        start=start,
        end=start + float(e["dur"]),
        category=cat,
        nccl=cat == "kernel" and "nccl" in str(e.get("name", "")).lower(),
        launch=None if launch is None else launch[0],
        launch_tid=None if launch is None else launch[1],
    )


class _HostView:
    """What the host was doing, from the trace's CPU-side events."""

    def __init__(self, events: list[dict]) -> None:
        self.launches: dict[Any, tuple[float, Any]] = {}  # correlation -> (ts, tid)
        self.syncs: list[Interval] = []
        self.data: list[Interval] = []
        self.steps: list[tuple[float, float, str]] = []
        ops: dict[Any, list[Interval]] = defaultdict(list)
        for e in events:
            cat = str(e.get("cat", "")).lower()
            name = str(e.get("name", ""))
            start = float(e["ts"])
            end = start + float(e["dur"])
            if cat in _LAUNCH_CATEGORIES:
                corr = _correlation(e)
                if corr is not None:
                    self.launches[corr] = (start, e.get("tid"))
                if name in SYNC_CALLS:
                    self.syncs.append((start, end))
            elif cat in DEVICE_CATEGORIES or cat.startswith("gpu_"):
                continue  # device-side (gpu_user_annotation mirrors host annotations)
            elif name.startswith(_STEP_PREFIX):
                self.steps.append((start, end, name))
            elif "DataLoader" in name:
                self.data.append((start, end))
            elif cat == "cpu_op":
                ops[e.get("tid")].append((start, end))
        self.steps.sort()
        self.data = merge(self.data)
        self.syncs = merge(self.syncs)
        # Outermost operators per thread: the host was "enqueueing" while inside one.
        self.ops = {tid: merge(spans) for tid, spans in ops.items()}
        self._op_starts = {tid: [s for s, _ in spans] for tid, spans in self.ops.items()}

    def in_op(self, tid: Any, t: float) -> bool:
        starts = self._op_starts.get(tid)
        if not starts:
            return False
        i = bisect.bisect_right(starts, t) - 1
        return i >= 0 and self.ops[tid][i][1] >= t

    def in_sync(self, t: float) -> bool:
        return any(s - _TOLERANCE_US <= t <= e + _TOLERANCE_US for s, e in self.syncs)


def _classify(
    holes: list[Interval], device: list[_DeviceEvent], host: _HostView
) -> tuple[dict[str, float], float]:
    """Split each hole in device activity by cause (µs); also the host-wait total."""
    causes = dict.fromkeys(names(), 0.0)
    host_wait = 0.0
    by_start: dict[float, list[_DeviceEvent]] = defaultdict(list)
    for d in device:
        by_start[d.start].append(d)
    for g0, g1 in holes:
        length = g1 - g0
        nexts = [d for d in by_start.get(g1, []) if d.launch is not None]
        first = min(nexts, key=lambda d: d.launch) if nexts else None
        if first is None or first.launch <= g0:
            # No launch record: cannot say the host was late. Launched in time: the GPU
            # waited on itself. Either way none of the host's causes.
            split = split_gap(length, {}, {})
        else:
            host_wait += length
            split = split_gap(
                length,
                {"data_wait": overlap_length((g0, g1), host.data)},
                {"sync_stall": host.in_sync(g0),
                 "launch_bound": host.in_op(first.launch_tid, g0)},
            )  # fmt: skip
        for name, ms in split.items():
            causes[name] += ms or 0.0
    return causes, host_wait


def _per_step(device: list[_DeviceEvent], host: _HostView) -> list[StepIdle]:
    if not host.steps:
        return []
    starts = [s for s, _, _ in host.steps]
    members: list[list[_DeviceEvent]] = [[] for _ in host.steps]
    for d in device:
        t = d.launch if d.launch is not None else d.start
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0 and t <= host.steps[i][1]:
            members[i].append(d)
    out: list[StepIdle] = []
    prev_end: float | None = None
    for (_, _, name), mine in zip(host.steps, members, strict=True):
        step, last = _step_idle(name, mine, prev_end, host)
        out.append(step)
        if last is not None:
            prev_end = last if prev_end is None else max(prev_end, last)
    return out


def _step_idle(
    name: str, mine: list[_DeviceEvent], prev_end: float | None, host: _HostView
) -> tuple[StepIdle, float | None]:
    """One step's idle from the device events its launches made, and where they ended;
    the gap since the step before counts as this step's."""
    busy_merged = merge((d.start, d.end) for d in mine)
    if not busy_merged:
        return StepIdle(name, 0.0, 0.0, 0.0, None, 0, dict.fromkeys(names(), 0.0)), None
    first, last = busy_merged[0][0], busy_merged[-1][1]
    holes = gaps(busy_merged)
    gap_before = None if prev_end is None else max(0.0, first - prev_end)
    if gap_before:
        holes.insert(0, (prev_end, first))
    causes, _ = _classify(holes, mine, host)
    busy = sum(e - s for s, e in busy_merged)
    step = StepIdle(
        name=name,
        span_ms=_ms(last - first),
        busy_ms=_ms(busy),
        idle_ms=_ms(last - first - busy),
        gap_before_ms=None if gap_before is None else _ms(gap_before),
        device_events=len(mine),
        causes={c: _ms(v) for c, v in causes.items()},
    )
    return step, last


def _correlation(event: dict) -> Any:
    args = event.get("args") or {}
    return args.get("correlation")


def _ms(us: float) -> float:
    return us / 1e3
