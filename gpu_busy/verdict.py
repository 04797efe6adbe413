"""One line per run: what bounds it, the figure that shows it, and the first thing to try.

``decide`` reads the reports the callbacks already write (``idle.json``'s and
``syncs.json``'s contents) and applies one rule: every cause of lost device time is a share
of the device's step (idle by cause, the unhidden batch copy, the wait for a slower rank);
the largest share at or above its threshold bounds the run; when none is, the device itself
does. A cause the clock cannot measure (sync stalls and launch gaps need a GPU queue) is
not a candidate: it is never guessed. The rules and their thresholds are written down in
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

# A cause bounds the run at or above this share of the device's step.
THRESHOLDS = {
    "data": 0.05,
    "syncs": 0.05,
    "launches": 0.05,
    "host": 0.05,
    "copies": 0.05,
    "slow_rank": 0.10,
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


@dataclass(frozen=True)
class Verdict:
    cause: str  # a THRESHOLDS key, "device", or "unknown"
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

    candidates = [
        ("data", mean.get("idle_data_wait_ms"), _data_text),
        ("syncs", mean.get("idle_sync_stall_ms"), lambda ms, pct: _syncs_text(ms, pct, syncs)),
        ("launches", mean.get("idle_launch_bound_ms"), _launch_text),
        # The batch "transfer" less the copy is the host's work before the step (its hooks;
        # on a CPU all of it: there is no copy to wait for).
        ("host", _add(mean.get("idle_other_ms"), _host_part(mean)), _host_text),
        ("copies", mean.get("copy_ms") if cuda else None, _copies_text),
        *_slow_rank(idle.get("ranks") or []),
    ]  # fmt: skip
    bound = [
        (ms / step, cause, text)
        for cause, ms, text in candidates
        if ms is not None and ms / step >= THRESHOLDS[cause]
    ]
    if not bound:
        idle_pct = 100 * mean["idle_ms"] / step
        what = "GPU" if cuda else "device"
        return Verdict(
            "device",
            mean["device_ms"] / step,
            f"verdict: bound by {device}: idle {idle_pct:.1f}% of a step, no cause "
            f"at or above its threshold ({_thresholds()}). First try: make the step cheaper "
            f"on the {what} (bf16-mixed precision, torch.compile, a larger batch).{syncs_text}",
        )
    share, cause, text = max(bound, key=lambda b: b[0])
    pct = f"{100 * share:.0f}% of a step; a problem above {100 * THRESHOLDS[cause]:.0f}%"
    return Verdict(cause, share, f"verdict: bound by {text(share * step, pct)}{syncs_text}")


def _host_part(mean: dict[str, Any]) -> float | None:
    transfer = mean.get("transfer_ms")
    if transfer is None:
        return None
    return max(0.0, transfer - (mean.get("copy_ms") or 0.0))


def _data_text(ms: float, pct: str) -> str:
    return (
        f"data loading: the device waited {ms:.2f} ms per batch for the DataLoader ({pct}). "
        "First try: more DataLoader workers (num_workers), persistent_workers=True, and "
        "decoding or augmenting less per sample on the host"
    )


def _syncs_text(ms: float, pct: str, syncs: dict | None) -> str:
    top = ""
    sites = (syncs or {}).get("sites") or []
    if sites:
        s = sites[0]
        cost = s.get("idle_after_ms_per_batch")
        cost_text = f", {cost:.2f} ms of idle per batch after it" if cost is not None else ""
        where = s.get("location") or f"{s.get('filename')}:{s.get('lineno')}"
        top = f" The costliest sync: {s.get('op')} at {where}{cost_text}."
    return (
        f"host syncs: the GPU stood idle {ms:.2f} ms per batch after the host waited on it "
        f"({pct}).{top} First try: remove that read (log tensors, not .item(); keep "
        "conditions on the device)"
    )


def _launch_text(ms: float, pct: str) -> str:
    return (
        f"kernel launches: the GPU ran dry {ms:.2f} ms per batch while the host was still "
        f"launching ({pct}). First try: a larger batch, torch.compile (fewer, larger kernels) "
        "or CUDA graphs"
    )


def _host_text(ms: float, pct: str) -> str:
    return (
        f"the host's work between steps: the device sat {ms:.2f} ms per batch with nothing "
        f"queued, outside the DataLoader ({pct}). First try: a larger batch (the loop's "
        "per-step cost is fixed), less per-step logging and fewer per-step callbacks; a "
        "profiler window (touch <run dir>/TRACE) shows what runs there"
    )


def _copies_text(ms: float, pct: str) -> str:
    return (
        f"host-to-device copies: the batch's copy held the step back {ms:.2f} ms per batch on "
        f"the compute stream, beyond the host's own work before the step ({pct}). First "
        "try: StreamPrefetcher (copies on a side stream) and pin_memory=True in the DataLoader"
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


def _add(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a + (b or 0.0)


def _thresholds() -> str:
    return ", ".join(f"{k.replace('_', ' ')} {100 * v:.0f}%" for k, v in THRESHOLDS.items())
