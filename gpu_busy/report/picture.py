"""The pictures: one run's per-batch time breakdown, and two runs side by side.

Both draw with matplotlib (an optional dependency: without it they return None) and take
their causes, labels and colours from ``gpu_busy.idle.causes``.

Example::

    batch_breakdown({0: series.rows}, "idle.png", title="default/version_3")
    side_by_side(RunFiles("runs/a"), RunFiles("runs/b"), "compare.png")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gpu_busy.idle.causes as cause_table
from gpu_busy.idle.stats import StepSeries
from gpu_busy.report import rounded
from gpu_busy.report.files import RunFiles


def batch_breakdown(
    series: dict[int, list[list[float]]],
    path: str | Path,
    title: str = "",
    causes: tuple[str, ...] | None = None,
) -> Path | None:
    """Draw the per-batch breakdown, averaged over ranks by batch; None without matplotlib.

    Three panels on one x axis, each on its own scale (idle is often a hundredth of the
    device time): the device's time (step and transfer), the idle time by cause (only
    ``causes``, by name, default all: leave out those the clock cannot tell), and the
    host's DataLoader wait.
    """
    plt = _pyplot()
    if plt is None:
        return None
    from matplotlib.ticker import MaxNLocator

    rows = _mean_by_step(series)
    if not rows:
        return None
    col = {name: i for i, name in enumerate(StepSeries.COLUMNS)}
    steps = [r[col["step"]] for r in rows]
    device = [("step", "device_ms", "#4c72b0"), ("transfer", "transfer_ms", "#8172b3")]
    shown = [cause_table.by_name(c) for c in (causes or cause_table.names())]
    panels = [
        ("device time (ms)", device),
        ("idle before it (ms)", [(c.label, c.key, c.colour) for c in shown]),
        ("host DataLoader\nwait (ms)", [("wait", "loader_wait_ms", "#55a868")]),
    ]  # fmt: skip
    fig, axes = plt.subplots(
        3, 1, figsize=(10, 7), sharex=True, gridspec_kw={"height_ratios": [2, 2, 1]}
    )
    for ax, (ylabel, layers) in zip(axes, panels, strict=True):
        _stacked(ax, steps, [[r[col[key]] for r in rows] for _, key, _ in layers], layers)
        ax.set_ylabel(ylabel)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    axes[0].set_title(title or "where each training batch's time went")
    axes[-1].set_xlabel("training batch")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    return _save(plt, fig, path)


def _stacked(ax: Any, steps: list[float], values: list[list[float]], layers: list) -> None:
    """``values`` stacked over the batches: bars while each batch can be seen (a single
    one too), an area past 50."""
    labels, colors = [label for label, _, _ in layers], [c for _, _, c in layers]
    if len(steps) >= 50:
        ax.stackplot(steps, *values, labels=labels, colors=colors)
        return
    bottom = [0.0] * len(steps)
    for v, label, colour in zip(values, labels, colors, strict=True):
        ax.bar(steps, v, bottom=bottom, label=label, color=colour, width=0.8)
        bottom = [b + x for b, x in zip(bottom, v, strict=True)]


def _mean_by_step(series: dict[int, list[list[float]]]) -> list[list[float]]:
    sums: dict[float, list[float]] = {}
    counts: dict[float, int] = {}
    for rows in series.values():
        for r in rows:
            acc = sums.setdefault(r[0], [0.0] * len(r))
            for i, v in enumerate(r):
                acc[i] += v
            counts[r[0]] = counts.get(r[0], 0) + 1
    return [[v / counts[s] for v in sums[s]] for s in sorted(sums)]


def side_by_side(a: RunFiles, b: RunFiles, path: str | Path) -> Path | None:
    """Two panels: each run's batch as one stacked bar (the step, the transfer, the idle)
    with its throughput, and the idle by cause on its own scale (idle is often a hundredth
    of the step); None without matplotlib or idle reports."""
    plt = _pyplot()
    if plt is None:
        return None
    if not (a.files.get("idle") and b.files.get("idle")):
        return None
    runs = ((1, "A", a), (0, "B", b))
    lost = [("transfer", "transfer_ms", "#8172b3")]  # the colours of the idle picture
    lost += [(f"idle: {c.label}", c.key, c.colour) for c in cause_table.TABLE]
    lost = [p for p in lost if any(r.figure("idle", ("mean", p[1])) for _, _, r in runs)]
    fig, (whole, parts) = plt.subplots(1, 2, figsize=(11, 3), gridspec_kw={"width_ratios": [3, 2]})
    _whole_batches(whole, runs, lost, a, b)
    _time_lost(parts, runs, lost)
    return _save(plt, fig, path)


def _whole_batches(ax: Any, runs: tuple, lost: list, a: RunFiles, b: RunFiles) -> None:
    """Each run's batch as one stacked bar (the step, then the time lost), with its rate."""
    longest = 0.0
    for y, _, run in runs:
        left = 0.0
        for label, key, colour in [("the step", "device_ms", "#4c72b0"), *lost]:
            width = run.figure("idle", ("mean", key)) or 0.0
            ax.barh(y, width, left=left, color=colour, label=label if y else None)
            left += width
        name, value = run.rate(like=a if run is b else b)
        ax.text(left, y, f" {rounded(value)} {name}", va="center", fontsize=8)
        longest = max(longest, left)
    ax.set_xlim(0, longest * 1.3 or 1)
    ax.set_yticks([1, 0], ["A", "B"])
    ax.set_xlabel("ms per training batch (mean over ranks)")
    ax.set_title(f"A: {a.folder}\nB: {b.folder}", fontsize=7, loc="left")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=8, frameon=False)


def _time_lost(ax: Any, runs: tuple, lost: list) -> None:
    """The time lost, each kind for both runs, on its own scale."""
    height = 0.38
    for y, tag, run in runs:
        values = [run.figure("idle", ("mean", key)) or 0.0 for _, key, _ in lost]
        offsets = [i + (height / 2 if y else -height / 2) for i in range(len(lost))]
        ax.barh(offsets, values, height=height, color="0.3" if y else "0.7", label=tag)
    ax.set_yticks(range(len(lost)), [label for label, _, _ in lost], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per batch: the time lost, on its own scale")
    ax.legend(fontsize=8, frameon=False)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
