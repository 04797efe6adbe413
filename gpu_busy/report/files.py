"""The run files: what each report holds, writing one, reading a run directory's back.

A fit writes ``run.json``, ``idle.json``, ``syncs.json``, ``prefetch.json`` and
``throughput.json`` into its run
directory, each with one ``schema_version`` (raised when a key changes meaning or goes).
The ``TypedDict`` classes below are their layout; ``RunFiles`` reads a directory's files
for the verdict, ``compare`` and scripts, and refuses a layout newer than it knows.

Example::

    files = RunFiles("runs/default/version_3")
    print(files.figure("idle", ("mean", "idle_ms")), files.rate())
    write_report(Path("runs/default/version_3"), "run", {"fit_samples_per_s": 2410.0})
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypedDict

SCHEMA_VERSION = 5
# Keys renamed by a version, per file: an older file is read under the new names.
# 4: run.json's whole-fit rates were "samples_per_s" and "steps_per_s", the names
# throughput.json (and run.json's "throughput") give the steady rates.
RENAMED = {4: {"run": {"samples_per_s": "fit_samples_per_s", "steps_per_s": "fit_steps_per_s"}}}

NAMES = ("run", "idle", "syncs", "prefetch", "throughput")


# (label, file, keys) of a run's throughput, best first
RATES = (
    ("samples/s, steady", "throughput", ("samples_per_s",)),
    ("samples/s", "run", ("fit_samples_per_s",)),
    ("steps/s", "run", ("fit_steps_per_s",)),
)


class RunReport(TypedDict, total=False):
    seconds: float
    train_seconds: float  # the longest rank's, validation left out
    steps: int
    world_size: int
    samples: int | None  # None: a batch Lightning could not size
    fit_samples_per_s: float | None  # over train_seconds, summed over ranks
    fit_steps_per_s: float
    verdict: dict[str, Any]  # {"cause": ..., "share": ...}
    throughput: dict[str, Any]  # throughput.json's headline figures (report.run.THROUGHPUT_KEYS)


class IdleReport(TypedDict, total=False):
    clock: str  # "cuda events" or "host clock"
    world_size: int
    warmup_steps: int
    steps: int
    timed_steps: int
    mean: dict[str, float | None]  # IdleStats.means() keys, the mean over ranks
    rank_max: dict[str, float | None]  # the largest single rank's
    ranks: list[dict[str, Any]]  # every rank's own, with "rank"
    window_samples_per_s: list[float]  # each logging window's, summed over ranks
    traces: list[dict[str, Any]]  # analysed profiler windows
    trace_overhead_s: float
    picture: str | None


class SyncsReport(TypedDict, total=False):
    summary: dict[str, Any]  # gpu_busy.report.syncs.summary's keys
    sites: list[dict[str, Any]]  # SyncSite fields, location, per-batch costs; costliest first
    cpu_only: list[dict[str, Any]]  # the reads a GPU does not make (SyncSite.cpu_only)


class PrefetchReport(TypedDict, total=False):
    copy_ms: float | None
    exposed_copy_ms: float | None
    hidden_copy_pct: float | None
    batches: int
    pageable_batches: int
    unmoved_batches: int


class ThroughputReport(TypedDict, total=False):
    clock: str  # "cuda events" or "host clock"
    world_size: int
    warmup_steps: int
    timed_steps: int  # the fewest of any rank
    untimed_steps: int  # lost because the event pool ran dry
    device: str
    precision: str | None  # "fp32", "tf32", "bf16", "fp16"; None: none the table knows
    samples_per_s: float | None  # summed over ranks; None: a batch had no size
    tokens_per_s: float | None  # summed over ranks; None: a batch did not say
    steps_per_s: float | None  # per rank, the mean
    flops_per_batch: float | None  # forward + backward
    flops_counted: str  # how, or why not
    flop_counts: list[dict[str, Any]]  # each count: first and last step it covers, why
    samples_counted: str  # how a batch's samples were counted
    samples_note: str | None  # where that count may be wrong (a nested batch)
    peak_tflops: float | None
    peak_source: str  # the datasheet, or why there is no peak
    achieved_tflops: float | None  # per device, the mean over ranks
    mfu: float | None  # a fraction, the mean over ranks
    peak_allocated_gib: float | None  # the largest rank's
    peak_reserved_gib: float | None
    ranks: list[dict[str, Any]]  # every rank's own, with "rank"


def write_report(folder: Path, name: str, report: dict) -> Path:
    """``<folder>/<name>.json`` with the schema version; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps({"schema_version": SCHEMA_VERSION, **report}, indent=1))
    return path


class RunFiles:
    """The reports of one run directory; a missing file reads as None."""

    run: RunReport | None
    idle: IdleReport | None
    syncs: SyncsReport | None
    prefetch: PrefetchReport | None
    throughput: ThroughputReport | None

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise SystemExit(f"error: {folder} is not a directory: give a run directory")
        for name in NAMES:
            setattr(self, name, _read(self.folder / f"{name}.json", name))
        if not any(self.files.values()):
            raise SystemExit(
                f"error: {folder} holds no run.json, idle.json or syncs.json: give the run "
                "directory a fit wrote (runs/<name>/version_<n>)"
            )

    @property
    def files(self) -> dict[str, dict | None]:
        return {name: getattr(self, name) for name in NAMES}

    def figure(self, name: str, path: tuple[str, ...]) -> float | None:
        """A number from one file by its keys; None where missing or not a number."""
        value: Any = getattr(self, name)
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value if isinstance(value, int | float) else None

    def rate(self, like: RunFiles | None = None) -> tuple[str, float | None]:
        """The first of ``RATES`` this run has (and ``like`` too): steady samples/s on the
        device clock, the fit's samples/s, or steps/s where batches had no size."""
        for label, name, path in RATES:
            value = self.figure(name, path)
            if value is not None and (like is None or like.figure(name, path) is not None):
                return label, value
        return "throughput", None


def _read(path: Path, name: str) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: cannot read {path}: {err}") from None
    version = data.get("schema_version") if isinstance(data, dict) else None
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise SystemExit(
            f"error: {path} has schema_version {version!r}, this gpu_busy reads up to "
            f"{SCHEMA_VERSION}: compare with the gpu_busy that wrote it"
        )
    for since, files in RENAMED.items():
        for old, new in files.get(name, {}).items() if version < since else ():
            if old in data:
                data[new] = data.pop(old)
    return data
