"""The end-of-fit sync report: ``syncs.json``'s contents and the lines printed.

Built from every rank's sites merged into one ``SyncSiteTable`` and the watched-batch
totals summed over ranks (``SyncPointDetector`` gathers them).

Example::

    report, lines = end_of_fit(table, totals, world_size=2, batches=400,
                               optimizer_steps=400, costs=(0.012, 0.010), budget=0.01,
                               interval=100, fit_seconds=95.0)
"""

from __future__ import annotations

from dataclasses import asdict

from gpu_busy.idle.causes import thresholds
from gpu_busy.report import figure
from gpu_busy.report.files import SyncsReport
from gpu_busy.syncs.sampling import WatchSchedule
from gpu_busy.syncs.sites import SyncSiteTable


def end_of_fit(
    table: SyncSiteTable,
    totals,
    *,
    world_size: int,
    batches: int,
    optimizer_steps: int,
    costs: tuple[float | None, float | None],
    budget: float,
    interval: int,
    fit_seconds: float,
    always_watched: int = 0,
) -> tuple[SyncsReport, list[str]]:
    """``totals`` holds the watched batches and their syncs summed over ranks (all, and
    steady: neither a logging step nor right after one); ``costs`` a (watched, plain)
    batch's seconds and the plain batches' upper quartile; ``always_watched`` the first
    batches watched whatever they cost."""
    summary = _summary(table, totals, world_size, batches, costs, budget, interval, fit_seconds)
    summary["always_watched"] = always_watched
    # A watched batch is one training batch: under gradient accumulation, fewer
    # optimizer steps than batches.
    steps = f" ({optimizer_steps} optimizer steps)" if optimizer_steps != batches else ""
    per_rank = " per rank" if world_size > 1 else ""
    headline = (
        f"sync points: {summary['watched_batches']} of {batches} training batches "
        f"watched{per_rank}{steps}; {figure(summary['syncs_per_batch'])} syncs/batch, "
        f"{figure(summary['steady_syncs_per_batch'])} in steady state (not the first step, "
        f"not logging steps); {_overhead(summary)}"
    )
    watched = totals.watched if table.costs else None
    sites = [
        {
            **asdict(s),
            "location": s.location,  # as printed: relative, or inside site-packages
            "idle_after_ms_per_batch": s.idle_per_batch(watched) if watched else None,
            "host_ms_per_batch": s.host_per_batch(watched) if watched else None,
        }
        for s in table.ranked(watched)
    ]
    cpu_only = [{**asdict(s), "location": s.location} for s in table.cpu_only()]
    lines = [headline] + ([_cost_line(summary)] if sites else [])
    if sites and world_size > 1:
        # The headline's batches are one rank's; a site's count is every rank's together.
        lines.append(f"  counts below are summed over the {world_size} ranks")
    lines += table.render(watched=watched, step_ms=summary["step_ms"])
    return {"summary": summary, "sites": sites, "cpu_only": cpu_only}, lines


def _summary(table, totals, world_size, batches, costs, budget, interval, fit_seconds) -> dict:
    watched_s, plain_s, plain_high_s = (*costs, None)[:3]
    ratio = WatchSchedule.overhead(watched_s, plain_s)
    within_spread = ratio is not None and watched_s <= max(plain_s, plain_high_s or 0.0)
    if within_spread:
        ratio = None  # no slower than the plain steps' own spread: not resolved
    amortised = None
    if ratio is not None:
        # watched batches per rank x their extra time, against this fit's wall time
        extra_s = totals.watched / world_size * ratio * plain_s
        amortised = extra_s / max(1e-9, fit_seconds)
    step_ms = 1e3 * plain_s if plain_s else None
    idle = host = None
    if table.costs and totals.watched:
        idle, host = (
            sum(getattr(s, name) for s in table.ranked()) / totals.watched
            for name in ("idle_after_ms", "host_ms")
        )
    return {
        "watched_batches": int(totals.watched / world_size),
        "steady_watched_batches": int(totals.steady_watched / world_size),
        "batches": batches,
        "syncs_per_batch": _ratio(totals.syncs, totals.watched),
        "steady_syncs_per_batch": _ratio(totals.steady_syncs, totals.steady_watched),
        "watched_batch_overhead": ratio,
        "overhead_within_spread": within_spread,
        "amortised_overhead": amortised,
        "interval": interval,
        "budget": budget,
        "sites": len(table.ranked()),
        "cpu_only_sites": len(table.cpu_only()),  # reads a GPU does not make (not counted)
        "step_ms": step_ms,  # a batch's wall time when not watched
        # GPU idle after syncs and the host's wait in them, per watched batch (None: CPU)
        "sync_idle_ms_per_batch": idle,
        "sync_idle_share": idle / step_ms if idle is not None and step_ms else None,
        "sync_host_ms_per_batch": host,
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _cost_line(summary: dict) -> str:
    """What all syncs together cost the GPU: the most removing every one could gain."""
    idle = summary.get("sync_idle_ms_per_batch")
    if idle is None:
        return "  cost of the syncs: n/a (no GPU queue on this machine; ranked by count)"
    share = summary.get("sync_idle_share")
    pct = "n/a" if share is None else f"{100 * share:.1f}%"
    return (
        f"  cost of the syncs: {idle:.3f} ms of GPU idle after them per batch ({pct} of a "
        f"step; removing every one gains at most that; worth it above "
        f"{100 * thresholds()['syncs']:.0f}%), host waited "
        f"{summary['sync_host_ms_per_batch']:.3f} ms in them"
    )


def _overhead(summary: dict) -> str:
    w, a = summary.get("watched_batch_overhead"), summary.get("amortised_overhead")
    if summary.get("overhead_within_spread"):
        return "overhead not resolved (a watched batch was within the other batches' spread)"
    if w is None:
        return "overhead not measured (too few batches to compare)"
    amort = "n/a" if a is None else f"{100 * a:.2f}%"
    over = ""
    budget = summary["budget"]
    if a is not None and a > budget:
        # the always-watched first batches alone, against the fit's length
        alone = summary.get("always_watched", 0) * w / max(1, summary["batches"])
        why = (
            "the fit was too short"
            if alone > budget
            else "the cost measured while it ran was lower (a loaded machine hides it)"
        )
        over = f", over the {100 * budget:.0f}% budget: {why}"
    return f"a watched batch costs +{100 * w:.0f}%, amortised {amort} of fit time{over}"
