"""Why the GPU waited: one row per idle cause, read by everything that names one.

A row is a cause's name (``idle_<name>_ms``), label, verdict name and threshold, whether a
host clock can tell it, colour and advice; ``split_gap`` divides a gap by the rows. A new
cause is a row and the ``IdleStats`` field that sums it. The rules: docs/ARCHITECTURE.md,
"Idle time".

Example::

    split_gap(6.0, overlaps={"data_wait": 2.0}, holds={"sync_stall": True})
    # {"data_wait": 2.0, "sync_stall": 4.0, "launch_bound": 0.0, "other": 0.0}
    split_gap(6.0, overlaps={"data_wait": 2.0}, holds=None)   # a host clock
    # {"data_wait": 2.0, "sync_stall": None, "launch_bound": None, "other": 4.0}
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cause:
    name: str  # the figure's key is ``key``: idle_<name>_ms
    label: str  # in the report, compare and the picture
    verdict: str  # what the verdict calls it ("bound by <bound_by>")
    threshold: float  # the share of a step at or above which it bounds the run
    on_host_clock: bool  # a host clock can tell it (else None there: never guessed)
    colour: str  # the picture's
    bound_by: str  # the verdict's words, with {ms}: the idle per batch
    advice: str  # the verdict's "First try"
    rule: str  # which part of a gap it gets

    @property
    def key(self) -> str:
        """The key of its figure in ``IdleStats``, ``idle.json`` and the logged metrics."""
        return f"idle_{self.name}_ms"


# The verdict's words wherever it advises a larger batch. At the same epochs a larger
# batch takes fewer optimizer steps, and too few steps lose accuracy whatever the learning
# rate: measured on a GPU machine and the CPU (docs/BENCHMARKS.md, "A larger batch").
LARGER_BATCH = (
    "a larger batch (fewer optimizer steps an epoch: if accuracy falls, keep the steps, "
    "with max_steps or a larger max_epochs)"
)

TABLE: tuple[Cause, ...] = (
    Cause(
        "data_wait", "data wait", "data", 0.05, True, "#dd8452",
        "data loading: the device waited {ms:.2f} ms per batch for the DataLoader",
        "more DataLoader workers (num_workers), persistent_workers=True, and decoding or "
        "augmenting less per sample on the host",
        "the part of the gap the host spent waiting for the DataLoader",
    ),
    Cause(
        "sync_stall", "sync stall", "syncs", 0.05, False, "#c44e52",
        "host syncs: the GPU stood idle {ms:.2f} ms per batch after the host waited on it",
        "remove that read (log tensors, not .item(); keep conditions on the device)",
        "the rest, when the GPU ran dry while the host waited in a sync",
    ),
    Cause(
        "launch_bound", "launch-bound", "launches", 0.05, False, "#937860",
        "kernel launches: the GPU ran dry {ms:.2f} ms per batch while the host was still "
        "launching",
        "CUDA graphs, which replay the whole step's kernels from one launch: "
        'torch.compile(mode="reduce-overhead") (the example: --model.compile=reduce-overhead); '
        f"or fewer, larger kernels: {LARGER_BATCH}",
        "the rest, when the GPU ran dry while the host was still running the step",
    ),
    Cause(
        "other", "other", "host", 0.05, True, "#8c8c8c",
        "the host's work between steps: the device sat {ms:.2f} ms per batch with nothing "
        "queued, outside the DataLoader",
        f"{LARGER_BATCH}, since the loop's cost is per step; less per-step logging and "
        "fewer per-step callbacks (torch.compile and CUDA graphs shorten the step, not the "
        "host's work between steps); a profiler window (touch <run dir>/TRACE) shows what "
        "runs there",
        "the rest otherwise: the host between steps, busy with something else",
    ),
)  # fmt: skip

# Device time lost outside the gaps, which the verdict also weighs (gpu_busy.verdict): the
# host's work between the batch's arrival and the step, the batch's copy, a slow rank.
OTHER_THRESHOLDS = {"transfer": 0.05, "copies": 0.05, "slow_rank": 0.10}


_names: tuple = ((), (), ())  # (TABLE, its names, those a host clock cannot tell)


def _names_of_table() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Read at every step: built again only when TABLE is another tuple (a test adds a
    row), not on each call."""
    global _names
    if _names[0] is not TABLE:
        _names = (
            TABLE,
            tuple(c.name for c in TABLE),
            tuple(c.name for c in TABLE if not c.on_host_clock),
        )
    return _names[1], _names[2]


def names() -> tuple[str, ...]:
    return _names_of_table()[0]


def thresholds() -> dict[str, float]:
    """The share of a step at or above which each verdict cause bounds a run."""
    return {**{c.verdict: c.threshold for c in TABLE}, **OTHER_THRESHOLDS}


def by_name(name: str) -> Cause:
    return next(c for c in TABLE if c.name == name)


def split_gap(
    length: float, overlaps: dict[str, float], holds: dict[str, bool] | None
) -> dict[str, float | None]:
    """Divide one gap of ``length`` by cause.

    ``overlaps``: causes measured as an amount of the gap (the DataLoader wait within it);
    they come first. ``holds``: for the rest, whether each cause's condition held when the
    GPU ran dry; the first row whose condition held takes all of it, else the last row.
    ``holds=None``: a host clock, which cannot tell the GPU-only causes: those are None.
    """
    every, not_on_host_clock = _names_of_table()
    out: dict[str, float | None] = dict.fromkeys(every, 0.0)
    rest = length
    for name, amount in overlaps.items():
        taken = max(0.0, min(rest, amount))
        out[name] = taken
        rest -= taken
    if holds is None:
        for name in not_on_host_clock:
            out[name] = None
        holds = {}
    taker = next((name for name in every if holds.get(name)), every[-1])
    out[taker] = (out[taker] or 0.0) + rest
    return out
