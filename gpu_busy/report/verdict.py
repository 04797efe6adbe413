"""One line per run: what bounds it, the figure that shows it, and the first thing to try.

``decide`` reads ``idle.json``'s and ``syncs.json``'s contents: every cause of lost device
time is a share of the step, and the largest at or above its threshold bounds the run,
else the device itself. A cause the clock cannot measure is never a candidate. The rules:
docs/ARCHITECTURE.md, "The verdict".

Example::

    verdict = decide(idle_report, syncs_report)
    print(verdict.line)
    # bound by data loading: the GPU waited 41.2 ms per batch for the DataLoader (38% of a
    # step; a problem above 5%). First try: more DataLoader workers (num_workers), ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gpu_busy.idle.causes as cause_table
from gpu_busy.report import site_location
from gpu_busy.report.idle import COPY, TRANSFER_HOST, untimed


@dataclass(frozen=True)
class Verdict:
    cause: str  # a cause_table.thresholds() key, "device", or "unknown"
    share: float | None  # of the device's step
    line: str


def decide(idle: dict[str, Any] | None, syncs: dict[str, Any] | None = None) -> Verdict:
    """The verdict from an idle report (required for one) and a sync report (optional)."""
    mean = (idle or {}).get("mean") or {}
    parts = [mean.get(k) for k in ("idle_ms", "transfer_ms", "device_ms")]
    if any(p is None for p in parts) or sum(parts) <= 0:
        return Verdict("unknown", None, f"verdict: n/a ({untimed(idle)})")
    step = sum(parts)
    cuda = idle.get("clock") == "cuda events"
    device = "the GPU itself" if cuda else "the CPU itself (no GPU here: host clocks stand in)"
    syncs_text = _syncs_seen(syncs, cuda)

    limit = cause_table.thresholds()
    bound = [
        (ms / step, cause, text)
        for cause, ms, text in _candidates(idle, syncs, cuda)
        if ms is not None and ms / step >= limit[cause]
    ]
    if not bound:
        idle_pct = 100 * mean["idle_ms"] / step
        what = "GPU" if cuda else "device"
        return Verdict(
            "device",
            mean["device_ms"] / step,
            f"verdict: bound by {device}: idle {idle_pct:.1f}% of a step, no cause "
            f"at or above its threshold ({_thresholds()}). First try: make the step cheaper "
            f"on the {what}: bf16-mixed precision, torch.compile's default mode (it fuses "
            "kernels: fewer trips through memory; the example: --model.compile=true), "
            f"channels_last for convolutions, {cause_table.LARGER_BATCH}.{syncs_text}",
        )
    share, cause, text = max(bound, key=lambda b: b[0])
    pct = f"{100 * share:.0f}% of a step; a problem above {100 * limit[cause]:.0f}%"
    return Verdict(cause, share, f"verdict: bound by {text(share * step, pct)}{syncs_text}")


def _candidates(idle: dict, syncs: dict | None, cuda: bool) -> list[tuple[str, Any, Any]]:
    """Each row of the idle table that can bound a run: ``(cause, ms per batch, text)``."""
    mean = idle["mean"]
    return [
        *((c.verdict, mean.get(c.key), _idle_text(c, syncs)) for c in cause_table.TABLE),
        ("transfer", mean.get("transfer_host_ms"), _transfer_text),
        ("copies", mean.get("copy_ms") if cuda else None, _copies_text),
        *_slow_rank(idle.get("ranks") or []),
    ]


def _idle_text(cause, syncs: dict | None):
    """The verdict's sentence for an idle cause, from its row in ``gpu_busy.idle.causes``;
    for syncs, with the costliest site the sync report names."""

    def text(ms: float, pct: str) -> str:
        detail = _costliest_sync(syncs) if cause.verdict == "syncs" else ""
        row = f'the idle table\'s "{cause.label}" row'
        return f"{cause.bound_by.format(ms=ms)} ({row}; {pct}).{detail} First try: {cause.advice}"

    return text


def _costliest_sync(syncs: dict | None) -> str:
    sites = (syncs or {}).get("sites") or []
    if not sites:
        return ""
    s = sites[0]
    cost = s.get("idle_after_ms_per_batch")
    cost_text = f", {cost:.2f} ms of idle per batch after it" if cost is not None else ""
    return f" The costliest sync: {s.get('op')} at {site_location(s)}{cost_text}."


def _transfer_text(ms: float, pct: str) -> str:
    return (
        f"the batch transfer: {TRANSFER_HOST} kept the device waiting {ms:.2f} ms per batch "
        "(Lightning's "
        "transfer, the on_before/on_after_batch_transfer hooks, the callbacks' "
        f"on_train_batch_start; {pct}). First try: {cause_table.LARGER_BATCH}, since that "
        "work is per batch, not per image; move host work in those hooks into the Dataset's "
        "workers, or do it on the device"
    )


def _copies_text(ms: float, pct: str) -> str:
    return (
        f"host-to-device copies: {COPY} held the step back {ms:.2f} ms per batch on the "
        f"compute stream ({pct}). First try: StreamPrefetcher (copies on a side stream) and "
        "pin_memory=True in the DataLoader"
    )


def _slow_rank(ranks: list[dict]) -> list[tuple]:
    """The wait that the slowest rank imposes on the others, where it can be measured: a
    slower DataLoader on one rank, and the others' longer backward (DDP's gradient
    all-reduce waits there for the last rank, on the host under gloo). Blind spot: waits
    inside forward's buffer broadcast and inside the device's own collectives (NCCL)."""
    if len(ranks) < 2:
        return []
    spreads = []
    for key, slowest in (("loader_wait_ms", max), ("host_backward_ms", min)):
        values = [(r.get(key), r.get("rank", i)) for i, r in enumerate(ranks)]
        if any(v is None for v, _ in values):
            continue
        spread = max(v for v, _ in values) - min(v for v, _ in values)
        spreads.append((spread, slowest(values)[1], key))
    if not spreads:
        return []
    spread, rank, key = max(spreads)
    where = (
        "its DataLoader is slower"
        if key == "loader_wait_ms"
        else "the others wait for it in backward's gradient all-reduce"
    )

    def text(ms: float, pct: str) -> str:
        return (
            f"one slow rank: rank {rank} holds the others back {ms:.2f} ms per batch ({where}; "
            f"{pct}). First try: compare that rank's machine, data shard and DataLoader with "
            "the others' (the per-rank figures are in idle.json)"
        )

    return [("slow_rank", spread, text)]


def _syncs_seen(syncs: dict | None, cuda: bool) -> str:
    """On a CPU run, the syncs found still matter on a GPU: say so, without a cost."""
    summary = (syncs or {}).get("summary") or {}
    steady = summary.get("steady_syncs_per_batch")
    if cuda or not steady:
        return ""
    return (
        f" ({steady:.2f} syncs per steady batch found: they cost nothing on a CPU; on a GPU "
        "each one drains the queue: see the sync report)"
    )


def _thresholds() -> str:
    return ", ".join(
        f"{k.replace('_', ' ')} {100 * v:.0f}%" for k, v in cause_table.thresholds().items()
    )
