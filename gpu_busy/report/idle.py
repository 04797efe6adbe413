"""The end-of-run idle report: one table, one JSON-ready dict, one picture, for all ranks.

``build_report`` takes each rank's whole-run ``IdleStats`` (and the analysed profiler
windows) and returns ``idle.json``'s contents: the mean over ranks, the largest value any
rank had (``rank_max``, per figure: the straggler), and every rank's own figures with its
rank. ``render_table`` prints it; ``end_of_fit`` adds the picture and the lines to print.

Example::

    report = build_report([stats_rank0, stats_rank1], cuda=True, clock="cuda events")
    for line in render_table(report):
        print(line)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gpu_busy.idle.causes as cause_table
from gpu_busy.idle.stats import IdleStats
from gpu_busy.report import figure
from gpu_busy.report.files import IdleReport
from gpu_busy.report.picture import batch_breakdown
from gpu_busy.window_sums import mean_and_max

# The sub-rows of the transfer, which the verdict names as the table does.
TRANSFER_HOST = "the host's work before the step"
COPY = "the copy, beyond the host's work"


def end_of_fit(
    per_rank: list[IdleStats],
    series: list[list[list[float]]],
    *,
    cuda: bool,
    clock: str,
    traces: list[dict],
    warmup_steps: int,
    trace_overhead_s: float,
    folder: Path | None,
    picture: bool,
) -> tuple[IdleReport, list[str]]:
    """The whole fit's report, its picture drawn into ``folder`` (``idle.png``), and the
    lines to print; ``series`` is each rank's ``StepSeries.rows``."""
    report = build_report(
        per_rank, cuda=cuda, clock=clock, traces=traces, warmup_steps=warmup_steps
    )
    report["trace_overhead_s"] = trace_overhead_s
    drawn = None
    if picture and folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        drawn = batch_breakdown(
            dict(enumerate(series)),
            folder / "idle.png",
            title=f"per batch, mean over {len(per_rank)} rank(s) ({clock})",
            causes=tuple(c.name for c in cause_table.TABLE if cuda or c.on_host_clock),
        )
    report["picture"] = str(drawn) if drawn else None
    lines = render_table(report)
    if folder is not None:
        where = f", picture {drawn}" if drawn else ""
        lines.append(f"idle report: {folder / 'idle.json'}{where}")
    return report, lines


def build_report(
    per_rank: list[IdleStats],
    *,
    cuda: bool,
    clock: str,
    traces: list[dict] | None = None,
    warmup_steps: int = 0,
) -> IdleReport:
    ranks = [s.means(cuda) for s in per_rank]
    mean, rank_max = mean_and_max(ranks)  # as the metrics reduce them
    return {
        "clock": clock,
        "world_size": len(per_rank),
        "warmup_steps": warmup_steps,
        "steps": per_rank[0].steps if per_rank else 0,
        "timed_steps": per_rank[0].timed_steps if per_rank else 0,
        "mean": mean,
        "rank_max": rank_max,
        "ranks": [{"rank": i, **r} for i, r in enumerate(ranks)],
        "traces": traces or [],
    }


def untimed(idle: dict[str, Any] | None) -> str:
    """Why an idle report holds no timed batch, and how many batches would give one."""
    if not idle:
        return "no idle report: add IdleTimeMonitor to the callbacks"
    warmup = int(idle.get("warmup_steps") or 0)
    return (
        f"no training batch was timed: the first {warmup} are warm-up (IdleTimeMonitor's "
        "warmup_steps) and a batch is timed only when the one before it ran in the same "
        f"epoch, with no validation between; {max(warmup + 1, 2)} batches in one epoch are "
        "enough"
    )


def render_table(report: dict[str, Any]) -> list[str]:
    """The report as aligned text lines: the mean over ranks, under DDP the largest value of
    any rank, and the share of a step at which a figure becomes a problem (the verdict's
    thresholds, ``gpu_busy.idle.causes``)."""
    mean, most = report["mean"], report["rank_max"]
    many = report["world_size"] > 1
    cuda = report["clock"] == "cuda events"
    title = (
        f"idle time: {report['steps']} training batches after the first "
        f"{report.get('warmup_steps', 0)} (warm-up, left out), {report['world_size']} "
        f"rank(s), timed by {report['clock']}"
    )
    if not report.get("timed_steps"):
        return [title, f"  n/a: {untimed(report)}"]
    rows: list[tuple[str, list[str], str]] = [
        ("per batch", ["mean", "rank max"][: 1 + many], "problem above")
    ]

    def row(
        label: str, key: str, problem: float | None = None, share: bool = True, unit: str = " ms"
    ) -> None:
        cells = [
            _cell(fig.get(key), fig.get("step_ms") if share else None, unit) for fig in (mean, most)
        ]
        tail = ""
        if problem:
            value, step = mean.get(key), mean.get("step_ms")
            over = value is not None and step and value / step >= problem
            tail = f"{100 * problem:.0f}% of a step" + ("  << over" if over else "")
        rows.append((label, cells[: 1 + many], tail))

    row("step on the device, all told", "step_ms", share=False)
    row("idle between steps", "idle_ms")
    for cause in cause_table.TABLE:
        row(f"  {cause.label}", cause.key, cause.threshold)
    limit = cause_table.thresholds()
    row("batch transfer on the compute stream", "transfer_ms")
    row(f"  {TRANSFER_HOST}", "transfer_host_ms", limit["transfer"])
    if cuda:  # on a host clock there is no copy: the host's work is all of the transfer
        row(f"  {COPY}", "copy_ms", limit["copies"])
    row("the step itself", "device_ms")
    if cuda:  # on a host clock these equal the rows above
        row("host: step", "host_step_ms", share=False)
        row("host: wait for the DataLoader", "loader_wait_ms", share=False)
        row("syncs per batch (CUDA sync debug, all)", "cuda_syncs_per_batch", share=False, unit="")
    if many:
        row("host: backward (holds DDP waits)", "host_backward_ms", share=False)
    return [title, *_aligned(rows), *_trace_lines(report.get("traces", []))]


def _aligned(rows: list[tuple[str, list[str], str]]) -> list[str]:
    # Columns as wide as their widest entry, so a long label or a four-digit time never runs
    # into its neighbour.
    label_w = max(len(label) for label, _, _ in rows) + 2
    cell_w = max(len(c) for _, cells, _ in rows for c in cells) + 3
    return [
        (f"{label:<{label_w}}" + "".join(f"{c:>{cell_w}}" for c in cells)
         + (f"   {tail}" if tail else "")).rstrip()
        for label, cells, tail in rows
    ]  # fmt: skip


def _trace_lines(traces: list[dict]) -> list[str]:
    """One line per profiler trace the report read."""
    lines = []
    for t in traces:
        if not t.get("device_events"):
            lines.append(f"trace {t.get('path', '')}: no device activity (a CPU run): n/a")
            continue
        causes = ", ".join(
            f"{c.label} {t['causes'][c.name]:.2f}"
            for c in cause_table.TABLE
            if t["causes"].get(c.name)
        )
        lines.append(
            f"trace {t.get('path', '')}: {t['span_ms']:.1f} ms span, idle "
            f"{figure(t.get('idle_pct'), '%')} ({t['idle_ms']:.2f} ms: {causes or 'none'}); "
            f"NCCL {t['nccl_ms']:.2f} ms"
        )
    return lines


def _cell(value: float | None, step_ms: float | None, unit: str = " ms") -> str:
    """``"2.16 ms (0.9%)"``: a figure per batch and, for a time, its share of the step; n/a
    where unknown."""
    if value is None:
        return "n/a"
    return figure(value, unit) + (f" ({100 * value / step_ms:.1f}%)" if step_ms else "")
