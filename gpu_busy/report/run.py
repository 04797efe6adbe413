"""The end-of-fit output: ``run.json``, the summary paragraph, and throughput, MFU and the
verdict above the held reports.

Example::

    run, paragraph = summary([[samples, seconds], ...], elapsed=95.2, steps=234, epochs=3)
    lines = under_verdict(held.take(), run)   # throughput and MFU, the verdict, every report
"""

from __future__ import annotations

from pathlib import Path

from gpu_busy.report.files import RunReport
from gpu_busy.report.verdict import decide

# The throughput report's headline figures, copied into run.json beside the fit's own.
THROUGHPUT_KEYS = (
    "samples_per_s",
    "tokens_per_s",
    "flops_per_batch",
    "mfu",
    "peak_allocated_gib",
    "peak_reserved_gib",
)


def _earlier_steps(checkpoint: str) -> str:
    """Where the reports of the steps before a resume are: beside the checkpoint's
    ``checkpoints/`` folder, in the run that saved it (a run cut short writes them too)."""
    folder = Path(checkpoint).parent
    if folder.name == "checkpoints":
        return (
            f"earlier steps' reports: {folder.parent} (the run that saved {Path(checkpoint).name})"
        )
    return f"earlier steps: see the run that wrote {checkpoint}"


def summary(
    ranks: list[list[float]],
    *,
    elapsed: float,
    steps: int,
    epochs: int,
    first_step: int = 0,
    resumed_from: str | None = None,
    best: tuple[str, float | None, str] | None = None,
) -> tuple[RunReport, str]:
    """``ranks`` holds each rank's [samples (-1: a batch had no size), training seconds
    without validation]; ``best`` the monitored metric, its value and the best checkpoint."""
    countable = all(r[0] >= 0 for r in ranks)
    samples = int(sum(r[0] for r in ranks))
    train_seconds = max(max(r[1] for r in ranks), 1e-9)  # the longest of the ranks
    world = len(ranks)
    run: RunReport = {
        "seconds": elapsed,
        "train_seconds": train_seconds,
        "steps": steps,
        "world_size": world,
        "samples": samples if countable else None,
        "fit_samples_per_s": samples / train_seconds if countable else None,
        "fit_steps_per_s": steps / train_seconds,
    }
    # The one samples/s printed is the throughput report's (steady, the device's clock);
    # run.json keeps the whole fit's host-clock rates for compare.
    counted = f", {samples:,} samples" if countable else ""
    resumed = f", resumed at step {first_step}" if first_step else ""
    parts = [
        f"fit done in {elapsed:.1f} s: {epochs} epoch(s), {steps} steps{resumed} over "
        f"{world} process(es){counted}"
    ]
    if first_step and resumed_from:
        parts.append(_earlier_steps(resumed_from))
    if best is not None:
        monitor, score, path = best
        if score is not None:
            parts.append(f"{monitor} {score:.4f}")
        if path:
            parts.append(f"best checkpoint {path}")
    return run, "; ".join(parts)


def under_verdict(held: list[tuple[str, dict, list[str]]], run: RunReport | None) -> list[str]:
    """The throughput report (its first line: throughput and MFU; its figures recorded in
    ``run``), the verdict line (with an idle report; recorded in ``run``), then the other
    held reports in the order they came."""
    reports = {name: report for name, report, _ in held}
    lines = [line for name, _, text in held if name == "throughput" for line in text]
    if run is not None and "throughput" in reports:
        run["throughput"] = {k: reports["throughput"].get(k) for k in THROUGHPUT_KEYS}
    if run is not None and "idle" in reports:
        verdict = decide(reports["idle"], reports.get("syncs"))
        lines.append(verdict.line)
        run["verdict"] = {"cause": verdict.cause, "share": verdict.share}
    return lines + [line for name, _, text in held if name != "throughput" for line in text]
