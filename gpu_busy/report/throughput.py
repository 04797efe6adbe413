"""The throughput report: samples/s, FLOPs per batch, MFU and peak memory, over all ranks.

Example::

    report, lines = end_of_fit(ranks, memory, flops=Flops(1.2e12, 32, "counted ..."),
                               peak=peak_flops(name, "bf16"), clock="cuda events", ...)
    headline(report)   # "throughput: 2,410 samples/s; MFU 41.2% (... of 990 TFLOP/s per device)"
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_busy.report import figure, rounded
from gpu_busy.report.files import ThroughputReport
from gpu_busy.throughput import MemoryStats, Peak, ThroughputStats, expandable_segments_on

# Reserved this far above allocated is fragmentation worth a line: both a share and an amount,
# so that neither a small model's cache nor a large one's rounding raises it.
FRAGMENTED_SHARE = 1.5
FRAGMENTED_GIB = 1.0


@dataclass(frozen=True)
class Flops:
    per_batch: float | None  # forward + backward of one batch (the last count); None: unknown
    samples: int | None  # the counted batch's size (None: no size, or given per batch)
    how: str  # how it was counted, or why there is no figure
    # each count with the steps it covers (FlopCounts.covered); the FLOP/s themselves come
    # from the timed steps' FLOPs, summed by ThroughputStats
    counts: list[dict] = field(default_factory=list)


def end_of_fit(
    ranks: list[ThroughputStats],
    memory: list[MemoryStats],
    *,
    flops: Flops,
    peak: Peak,
    device: str,
    precision: str | None,
    clock: str,
    warmup_steps: int,
    window_rates: list[float] | None = None,
    samples_counted: str = "",
    samples_note: str | None = None,
) -> tuple[ThroughputReport, list[str]]:
    """``ranks`` and ``memory`` hold each rank's sums over the fit, in rank order;
    ``window_rates`` the samples/s of each logging window (their spread is a run's noise);
    ``samples_counted`` how a batch's samples were counted, ``samples_note`` where that
    may be wrong."""
    per_rank = []
    for rank, (stats, mem) in enumerate(zip(ranks, memory, strict=True)):
        rates = stats.rates()
        achieved = stats.flops_per_s()
        per_rank.append(
            {
                "rank": rank,
                "timed_steps": stats.steps,
                **rates,
                "achieved_tflops": achieved / 1e12 if achieved is not None else None,
                "mfu": achieved / peak.flops if achieved is not None and peak.flops else None,
                **mem.gib(),  # None where no step was measured (off CUDA)
            }
        )
    report: ThroughputReport = {
        "clock": clock,
        "world_size": len(ranks),
        "warmup_steps": warmup_steps,
        "timed_steps": min((r["timed_steps"] for r in per_rank), default=0),
        "untimed_steps": sum(s.untimed_steps for s in ranks),
        "device": device,
        "precision": precision,
        "samples_per_s": _total(per_rank, "samples_per_s"),
        "tokens_per_s": _total(per_rank, "tokens_per_s"),
        "steps_per_s": _mean(per_rank, "steps_per_s"),
        "flops_per_batch": flops.per_batch,
        "flops_counted": flops.how,
        "flop_counts": flops.counts,
        "peak_tflops": peak.flops / 1e12 if peak.flops else None,
        "peak_source": peak.source,
        "achieved_tflops": _mean(per_rank, "achieved_tflops"),
        "mfu": _mean(per_rank, "mfu"),
        "peak_allocated_gib": _max(per_rank, "peak_allocated_gib"),
        "peak_reserved_gib": _max(per_rank, "peak_reserved_gib"),
        "ranks": per_rank,
        "window_samples_per_s": list(window_rates or []),
        "samples_counted": samples_counted,
        "samples_note": samples_note,
    }
    return report, lines(report)


def _values(per_rank: list[dict], key: str) -> list[float] | None:
    values = [r[key] for r in per_rank]
    return None if not values or any(v is None for v in values) else values


def _total(per_rank: list[dict], key: str) -> float | None:
    values = _values(per_rank, key)
    return sum(values) if values else None


def _mean(per_rank: list[dict], key: str) -> float | None:
    values = _values(per_rank, key)
    return sum(values) / len(values) if values else None


def _max(per_rank: list[dict], key: str) -> float | None:
    values = _values(per_rank, key)
    return max(values) if values else None


def headline(report: ThroughputReport) -> str:
    """Throughput and MFU in one line: what the run summary leads with."""
    world = report["world_size"]
    if not report["timed_steps"]:
        rate = (
            f"n/a (no step timed after the {report['warmup_steps']} warm-up steps: a longer "
            "run times some)"
        )
    elif report["samples_per_s"] is not None:
        rate = f"{rounded(report['samples_per_s'])} samples/s"
    else:
        rate = f"{figure(report['steps_per_s'])} steps/s (batches without a size)"
    if world > 1 and report["samples_per_s"] is not None:
        rate += f" over {world} ranks ({rounded(report['samples_per_s'] / world)} per rank)"
    if report["tokens_per_s"] is not None:
        rate += f", {rounded(report['tokens_per_s'])} tokens/s"
    mfu = report["mfu"]
    if mfu is not None:
        mfu_text = (
            f"MFU {100 * mfu:.1f}% ({figure(report['achieved_tflops'])} of "
            f"{rounded(report['peak_tflops'])} TFLOP/s per device)"
        )
    elif report["flops_per_batch"] is None:
        mfu_text = f"MFU n/a: FLOPs per batch unknown ({report['flops_counted']})"
    else:
        mfu_text = f"MFU n/a: {report['peak_source']}"
    return f"throughput: {rate}; {mfu_text}"


def lines(report: ThroughputReport) -> list[str]:
    """The report's text: the headline with its basis, then the memory line(s)."""
    steps = f"{report['timed_steps']} steps per rank after {report['warmup_steps']} warm-up"
    flops = report["flops_per_batch"]
    basis = (
        f"  ({report['clock']}, {steps}; FLOPs per batch "
        f"{'n/a' if flops is None else f'{flops:.3g}'}: {report['flops_counted']}"
    )
    if report["peak_tflops"] is not None:
        basis += f"; peak {report['peak_source']}"
    out = [headline(report), basis + ")"]
    if report.get("samples_note"):
        out.append(f"  {report['samples_note']}")
    allocated, reserved = report["peak_allocated_gib"], report["peak_reserved_gib"]
    if allocated is None or reserved is None:
        out.append("  peak memory n/a: only CUDA's caching allocator counts it")
        return out
    out.append(
        f"  peak memory {allocated:.2f} GiB allocated, {reserved:.2f} GiB reserved "
        "(the largest rank's, over the training steps)"
    )
    cached = reserved - allocated
    if reserved > FRAGMENTED_SHARE * allocated and cached > FRAGMENTED_GIB:
        advice = (
            "expandable_segments is on already"
            if expandable_segments_on()
            else "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets the allocator grow "
            "one segment instead"
        )
        out.append(
            f"  memory: {cached:.2f} GiB reserved above the peak allocation, cached in blocks "
            f"later allocations could not use (fragmentation); {advice}"
        )
    return out
