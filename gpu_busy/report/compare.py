"""Two runs side by side: throughput, MFU, memory, idle by cause, syncs and top sites.

Reads each run directory's files (a missing one's rows read n/a), prints one table and
both verdicts, draws ``compare.png``, and exits 1 when B fails a gate: throughput (B below
A by more than ``--threshold`` and beyond both runs' spread; off on a CPU), MFU, and syncs
(on a CPU or where they changed, or with ``--sync-threshold``); and when no gate had
figures of both runs to compare (a gate that checked nothing). Details: docs/GUIDE.md,
"Before and after: make compare".

Example::

    python -m gpu_busy.report.compare runs/default/version_0 runs/default/version_1
    python -m gpu_busy.report.compare A B --threshold 0.03 --picture before_after.png
    python -m gpu_busy.report.compare A B --sync-threshold 0      # and no new syncs
    make compare A=runs/default/version_0 B=runs/default/version_1 [SYNC_THRESHOLD=0]
"""

from __future__ import annotations

import argparse
import sys
from typing import NamedTuple

import gpu_busy.idle.causes as cause_table
from gpu_busy.report import rounded, site_location
from gpu_busy.report.files import RunFiles
from gpu_busy.report.picture import side_by_side
from gpu_busy.report.verdict import decide


def rows() -> list[tuple[str, str, tuple[str, ...], str]]:
    """(label, file, path to the figure, unit) of each row of the table."""
    return [
        ("samples/s, steady", "throughput", ("samples_per_s",), ""),
        ("tokens/s, steady", "throughput", ("tokens_per_s",), ""),
        ("MFU (a fraction of the peak)", "throughput", ("mfu",), ""),
        ("peak memory allocated", "throughput", ("peak_allocated_gib",), " GiB"),
        ("peak memory reserved", "throughput", ("peak_reserved_gib",), " GiB"),
        ("samples/s over the fit", "run", ("fit_samples_per_s",), ""),
        ("steps/s over the fit", "run", ("fit_steps_per_s",), ""),
        ("step on the device, all told", "idle", ("mean", "step_ms"), " ms"),
        ("idle share", "idle", ("mean", "idle_pct"), "%"),
        *((f"  idle: {c.label}", "idle", ("mean", c.key), " ms")
          for c in cause_table.TABLE),
        ("batch transfer on the compute stream", "idle", ("mean", "transfer_ms"), " ms"),
        ("the step itself", "idle", ("mean", "device_ms"), " ms"),
        ("syncs per batch, logging steps too", "syncs", ("summary", "syncs_per_batch"), ""),
        ("syncs per steady batch", "syncs", ("summary", "steady_syncs_per_batch"), ""),
        ("GPU idle after syncs, per batch", "syncs", ("summary", "sync_idle_ms_per_batch"),
         " ms"),
    ]  # fmt: skip


def top_sites(run: RunFiles, n: int = 3) -> list[str]:
    out = []
    for s in ((run.syncs or {}).get("sites") or [])[:n]:
        cost = s.get("idle_after_ms_per_batch")
        cost_text = f", {cost:.3f} ms idle/batch" if cost is not None else ""
        out.append(f"{s.get('count')}x {s.get('op')} at {site_location(s)}{cost_text}")
    return out


def compare(
    a: RunFiles, b: RunFiles, threshold: float, sync_threshold: float | None = None
) -> list[str]:
    """The table, the verdicts and the gates; the last line says whether B is worse
    (``worse:``)."""
    lines = [f"A: {a.folder}", f"B: {b.folder}", f"{'':<38}{'A':>12}{'B':>12}{'change':>12}"]
    for label, name, path, unit in rows():
        va, vb = a.figure(name, path), b.figure(name, path)
        if va is None and vb is None and name in ("run", "throughput"):
            continue
        cells = (rounded(va, unit), rounded(vb, unit), _change(va, vb, unit))
        lines.append(f"{label:<38}" + "".join(f"{c:>12}" for c in cells))
    for run, tag in ((a, "A"), (b, "B")):
        if run.idle:
            lines.append(f"{tag} {decide(run.idle, run.syncs).line}")
        sites = top_sites(run)
        lines.append(f"{tag} top sync sites: " + ("; ".join(sites) if sites else "none"))
    return lines + gates(a, b, threshold, sync_threshold)


class Gate(NamedTuple):
    line: str
    failed: bool = False
    checked: bool = True  # compared figures of both runs (not n/a, not off for the machine)
    gain: bool = False  # B better beyond what the gate allows
    noise: bool = False  # a throughput change within both runs' spread


def gates(a: RunFiles, b: RunFiles, threshold: float, sync_threshold: float | None) -> list[str]:
    """One line per gate, then the outcome: ``worse:`` when a gate that is on failed,
    ``checked nothing:`` when no gate compared a figure of both runs, ``better:`` when B has
    fewer syncs per steady batch or a throughput gain beyond both runs' spread, else
    ``ok:``. The first two exit 1.

    Throughput fails only by more than ``threshold`` and beyond both runs' own spread (the
    samples/s of their logging windows): two runs of the same code are not told apart by
    noise. Off on a CPU, where it measures the machine's load. The syncs gate is on where a
    run is on a CPU or the syncs changed (allowed +0 unless ``sync_threshold`` says)."""
    named = {"throughput": _throughput_gate(a, b, threshold), "MFU": _mfu_gate(a, b, threshold),
             "syncs": _syncs_gate(a, b, sync_threshold)}  # fmt: skip
    lines = [gate.line for gate in named.values()]
    failed = [name for name, gate in named.items() if gate.failed]
    gains = {"fewer syncs per steady batch": named["syncs"].gain,
             "more throughput beyond both runs' spread": named["throughput"].gain}  # fmt: skip
    if failed:
        lines.append(f"worse: B failed the {' and '.join(failed)} gate{'s' * (len(failed) > 1)}")
    elif not any(gate.checked for gate in named.values()):
        lines.append("checked nothing: no gate had figures of both runs to compare; give each "
                     "run a steady batch the sync check watches (more batches, or "
                     "SyncPointDetector's first_steps=)")  # fmt: skip
    elif any(gains.values()):
        why = [gain for gain, yes in gains.items() if yes]
        lines.append(f"better: B has {' and '.join(why)}, and failed no gate")
    else:
        noise = ", throughput within noise" if named["throughput"].noise else ""
        lines.append("ok: B failed no gate" + noise)
    return lines


def _on_cpu(run: RunFiles) -> bool:
    """Trained without a GPU: its throughput says so, or its idle report was timed by the
    host clock (the stand-in for CUDA events where there are none)."""
    return (run.throughput or {}).get("device") == "cpu" or (run.idle or {}).get(
        "clock"
    ) == "host clock"


def _windows(run: RunFiles) -> list[float]:
    rates = (run.throughput or {}).get("window_samples_per_s") or []
    return [r for r in rates if isinstance(r, int | float)]


def _throughput_gate(a: RunFiles, b: RunFiles, threshold: float) -> Gate:
    label, ta = a.rate(like=b)
    _, tb = b.rate(like=a)
    if not ta or tb is None:
        return Gate(f"throughput gate n/a: {label} not in both runs' files", checked=False)
    change = (tb - ta) / ta
    wa, wb = _windows(a), _windows(b)
    if len(wa) >= 2 and len(wb) >= 2 and "steady" in label:
        beyond = max(wb) < min(wa) if change < 0 else min(wb) > max(wa)
        noise = "beyond both runs' spread" if beyond else "within noise"
        spread = (f"{noise}: windows A {min(wa):,.0f} to {max(wa):,.0f}, "
                  f"B {min(wb):,.0f} to {max(wb):,.0f}")  # fmt: skip
    else:
        beyond, spread = True, "no logging windows to judge the noise by"
    figure = f"{label} {100 * change:+.1f}% ({spread})"
    if _on_cpu(a) or _on_cpu(b):
        return Gate(f"throughput gate off on a CPU, whose rate follows the machine's load: "
                    f"{figure}", checked=False, noise=not beyond)  # fmt: skip
    if not beyond:
        return Gate(f"throughput gate passed: {figure}", noise=True)
    fails = -change > threshold
    verdict = "FAILED" if fails else "passed"
    return Gate(f"throughput gate {verdict}: {figure}, allowed -{100 * threshold:g}%", fails,
                gain=change > threshold)  # fmt: skip


def _mfu_gate(a: RunFiles, b: RunFiles, threshold: float) -> Gate:
    ma, mb = a.figure("throughput", ("mfu",)), b.figure("throughput", ("mfu",))
    if not ma or mb is None:
        return Gate("MFU gate n/a: MFU not in both runs' throughput.json", checked=False)
    fails = (ma - mb) / ma > threshold
    return Gate(f"MFU gate {'FAILED' if fails else 'passed'}: {100 * ma:.1f}% -> "
                f"{100 * mb:.1f}% (allowed -{100 * threshold:g}% of A's)", fails)  # fmt: skip


def _syncs_gate(a: RunFiles, b: RunFiles, sync_threshold: float | None) -> Gate:
    sa = a.figure("syncs", ("summary", "steady_syncs_per_batch"))
    sb = b.figure("syncs", ("summary", "steady_syncs_per_batch"))
    if sa is None or sb is None:
        why = [f"{tag}'s syncs.json is missing" if run.syncs is None else
               f"{tag} watched no steady batch" for tag, run, figure in
               (("A", a, sa), ("B", b, sb)) if figure is None]  # fmt: skip
        return Gate(f"syncs gate n/a: syncs per steady batch n/a ({'; '.join(why)})",
                    checked=False)  # fmt: skip
    syncs = f"syncs per steady batch {sa:.2f} -> {sb:.2f}"
    if sync_threshold is None:
        if not (_on_cpu(a) or _on_cpu(b) or sa != sb):
            return Gate(f"syncs gate off: {syncs}, unchanged on a GPU")
        sync_threshold = 0.0  # a CPU's judge, and where the syncs changed
    fails = sb - sa > sync_threshold
    verdict = "FAILED" if fails else "passed"
    return Gate(f"syncs gate {verdict}: {syncs} (allowed +{sync_threshold:g})", fails,
                gain=sb < sa)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpu_busy.report.compare", description=__doc__.split("\n")[0]
    )
    parser.add_argument("a", help="the run directory before (runs/<name>/version_<n>)")
    parser.add_argument("b", help="the run directory after")
    parser.add_argument(
        "--threshold",
        type=float,
        default=0.05,
        help="largest throughput drop allowed, a fraction (0.05 = 5%%)",
    )
    parser.add_argument(
        "--sync-threshold",
        type=float,
        default=None,
        help="the largest rise allowed in syncs per steady batch (turns the syncs gate on; "
        "without it, on at +0 on a CPU or where the syncs changed)",
    )
    parser.add_argument(
        "--picture",
        default=None,
        help="where to draw the picture (default: compare.png in B; '' for none)",
    )
    args = parser.parse_args(argv)  # fmt: skip
    if not 0 <= args.threshold < 1 or (args.sync_threshold or 0) < 0:
        print("error: --threshold must be in [0, 1) and --sync-threshold >= 0", file=sys.stderr)
        return 2
    a, b = RunFiles(args.a), RunFiles(args.b)
    lines = compare(a, b, args.threshold, args.sync_threshold)
    picture = args.picture if args.picture is not None else b.folder / "compare.png"
    drawn = side_by_side(a, b, picture) if picture else None
    if drawn is not None:
        first_gate = next(i for i, line in enumerate(lines) if line.startswith("throughput gate"))
        lines.insert(first_gate, f"picture: {drawn}")
    print("\n".join(lines))
    return 1 if lines[-1].startswith(("worse:", "checked nothing:")) else 0


def _change(a: float | None, b: float | None, unit: str = "") -> str:
    if a is None or b is None:
        return ""
    if unit == "%":  # a share: the change in points
        return f"{b - a:+.1f} pt"
    if a == 0:
        return "" if b == 0 else f"{b - a:+.2f}"
    return f"{100 * (b - a) / abs(a):+.1f}%"


if __name__ == "__main__":
    sys.exit(main())
