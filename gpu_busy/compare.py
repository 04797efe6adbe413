"""Two runs side by side: throughput, idle by cause, syncs and top sites, with the change.

Reads the files the callbacks write in each run directory (``run.json``, ``idle.json``,
``syncs.json``; any may be missing: its rows read n/a), prints one table and both verdicts,
draws ``compare.png`` and exits 1 when B fails a gate, so that CI can gate on it. Two gates,
each named in the output: throughput (on; B's samples/s below A's by more than
``--threshold``, a fraction) and syncs (off unless ``--sync-threshold`` is given; B's syncs
per steady batch above A's by more than that).

Example::

    python -m gpu_busy.compare runs/default/version_0 runs/default/version_1
    python -m gpu_busy.compare A B --threshold 0.03 --picture before_after.png
    python -m gpu_busy.compare A B --sync-threshold 0      # and no new syncs
    make compare A=runs/default/version_0 B=runs/default/version_1 [SYNC_THRESHOLD=0]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import gpu_busy.idle.causes as cause_table
from gpu_busy.verdict import decide


def rows() -> list[tuple[str, str, tuple[str, ...], str]]:
    """(label, file, path to the figure, unit) of each row of the table."""
    return [
        ("samples/s", "run", ("samples_per_s",), ""),
        ("steps/s", "run", ("steps_per_s",), ""),
        ("step on the device, all told", "idle", ("mean", "step_ms"), " ms"),
        ("idle share", "idle", ("mean", "idle_pct"), "%"),
        *((f"  idle: {c.label}", "idle", ("mean", f"idle_{c.name}_ms"), " ms")
          for c in cause_table.TABLE),
        ("batch transfer on the compute stream", "idle", ("mean", "transfer_ms"), " ms"),
        ("the step itself", "idle", ("mean", "device_ms"), " ms"),
        ("syncs per batch, logging steps too", "syncs", ("summary", "syncs_per_batch"), ""),
        ("syncs per steady batch", "syncs", ("summary", "steady_syncs_per_batch"), ""),
        ("GPU idle after syncs, per batch", "syncs", ("summary", "sync_idle_ms_per_batch"),
         " ms"),
    ]  # fmt: skip


class RunFiles:
    """The reports of one run directory."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise SystemExit(f"error: {folder} is not a directory: give a run directory")
        self.files = {n: _read(self.folder / f"{n}.json") for n in ("run", "idle", "syncs")}
        if not any(self.files.values()):
            raise SystemExit(
                f"error: {folder} holds no run.json, idle.json or syncs.json: give the run "
                "directory a fit wrote (runs/<name>/version_<n>)"
            )

    def figure(self, name: str, path: tuple[str, ...]) -> float | None:
        value: Any = self.files.get(name)
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value if isinstance(value, int | float) else None

    def throughput(self) -> tuple[str, float | None]:
        for key in ("samples_per_s", "steps_per_s"):
            value = self.figure("run", (key,))
            if value is not None:
                return key.replace("_per_s", "/s"), value
        return "throughput", None

    def top_sites(self, n: int = 3) -> list[str]:
        out = []
        for s in ((self.files.get("syncs") or {}).get("sites") or [])[:n]:
            cost = s.get("idle_after_ms_per_batch")
            cost_text = f", {cost:.3f} ms idle/batch" if cost is not None else ""
            where = s.get("location") or f"{s.get('filename')}:{s.get('lineno')}"
            out.append(f"{s.get('count')}x {s.get('op')} at {where}{cost_text}")
        return out


def compare(
    a: RunFiles, b: RunFiles, threshold: float, sync_threshold: float | None = None
) -> list[str]:
    """The table, the verdicts and the gates; the last line says whether B is worse
    (``worse:``)."""
    lines = [f"A: {a.folder}", f"B: {b.folder}", f"{'':<38}{'A':>12}{'B':>12}{'change':>12}"]
    for label, name, path, unit in rows():
        va, vb = a.figure(name, path), b.figure(name, path)
        if va is None and vb is None and name == "run":
            continue
        cells = (_fmt(va, unit), _fmt(vb, unit), _change(va, vb, unit))
        lines.append(f"{label:<38}" + "".join(f"{c:>12}" for c in cells))
    for run, tag in ((a, "A"), (b, "B")):
        if run.files.get("idle"):
            lines.append(f"{tag} {decide(run.files['idle'], run.files.get('syncs')).line}")
        sites = run.top_sites()
        lines.append(f"{tag} top sync sites: " + ("; ".join(sites) if sites else "none"))
    return lines + gates(a, b, threshold, sync_threshold)


def gates(a: RunFiles, b: RunFiles, threshold: float, sync_threshold: float | None) -> list[str]:
    """One line per gate, then the outcome (``worse:`` when a gate that is on failed).

    Throughput is the gate: the figure a change is for. Syncs per steady batch is a gate of
    its own, on only with ``sync_threshold``: a faster B with more syncs is not worse, but
    it is said."""
    label, ta = a.throughput()
    _, tb = b.throughput()
    sa = a.figure("syncs", ("summary", "steady_syncs_per_batch"))
    sb = b.figure("syncs", ("summary", "steady_syncs_per_batch"))
    failed, lines = [], []
    if ta and tb is not None:
        change = (tb - ta) / ta
        fails = -change > threshold
        verdict = "FAILED" if fails else "passed"
        lines.append(f"throughput gate {verdict}: {label} {100 * change:+.1f}% "
                     f"(allowed -{100 * threshold:g}%)")  # fmt: skip
        if fails:
            failed.append("throughput")
    else:
        lines.append(f"throughput gate n/a: {label} not in both runs' run.json")
    if sa is None or sb is None:
        syncs = "syncs per steady batch n/a (a syncs.json is missing)"
    else:
        syncs = f"syncs per steady batch {sa:.2f} -> {sb:.2f}"
    if sync_threshold is None:
        lines.append(f"syncs gate off: {syncs} (--sync-threshold N turns it on)")
    elif sa is None or sb is None:
        lines.append(f"syncs gate n/a: {syncs}")
    else:
        fails = sb - sa > sync_threshold
        lines.append(f"syncs gate {'FAILED' if fails else 'passed'}: {syncs} "
                     f"(allowed +{sync_threshold:g})")  # fmt: skip
        if fails:
            failed.append("syncs")
    if failed:
        lines.append(f"worse: B failed the {' and '.join(failed)} gate{'s' * (len(failed) > 1)}")
    else:
        lines.append("ok: B failed no gate")
    return lines


def save_picture(a: RunFiles, b: RunFiles, path: str | Path) -> Path | None:
    """Two panels: each run's batch as one stacked bar (the step, the transfer, the idle)
    with its throughput, and the idle by cause on its own scale (idle is often a hundredth
    of the step); None without matplotlib or idle reports."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not (a.files.get("idle") and b.files.get("idle")):
        return None
    runs = ((1, "A", a), (0, "B", b))
    lost = [("transfer", "transfer_ms", "#8172b3")]  # the colours of the idle picture
    lost += [(f"idle: {c.label}", f"idle_{c.name}_ms", c.colour) for c in cause_table.TABLE]
    lost = [p for p in lost if any(r.figure("idle", ("mean", p[1])) for _, _, r in runs)]
    fig, (whole, parts) = plt.subplots(1, 2, figsize=(11, 3), gridspec_kw={"width_ratios": [3, 2]})
    longest = 0.0
    for y, _, run in runs:
        left = 0.0
        for label, key, colour in [("the step", "device_ms", "#4c72b0"), *lost]:
            width = run.figure("idle", ("mean", key)) or 0.0
            whole.barh(y, width, left=left, color=colour, label=label if y else None)
            left += width
        name, value = run.throughput()
        whole.text(left, y, f" {_fmt(value, '')} {name}", va="center", fontsize=8)
        longest = max(longest, left)
    whole.set_xlim(0, longest * 1.3 or 1)
    whole.set_yticks([1, 0], ["A", "B"])
    whole.set_xlabel("ms per training batch (mean over ranks)")
    whole.set_title(f"A: {a.folder}\nB: {b.folder}", fontsize=7, loc="left")
    height = 0.38
    for y, tag, run in runs:
        values = [run.figure("idle", ("mean", key)) or 0.0 for _, key, _ in lost]
        offsets = [i + (height / 2 if y else -height / 2) for i in range(len(lost))]
        parts.barh(offsets, values, height=height, color="0.3" if y else "0.7", label=tag)
    parts.set_yticks(range(len(lost)), [label for label, _, _ in lost], fontsize=8)
    parts.invert_yaxis()
    parts.set_xlabel("ms per batch: the time lost, on its own scale")
    parts.legend(fontsize=8, frameon=False)
    whole.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=8,
                 frameon=False)  # fmt: skip
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpu_busy.compare", description=__doc__.split("\n")[0]
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
        help="turn the syncs gate on: the largest rise allowed in syncs per steady batch",
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
    drawn = save_picture(a, b, picture) if picture else None
    if drawn is not None:
        lines.insert(-3, f"picture: {drawn}")
    print("\n".join(lines))
    return 1 if lines[-1].startswith("worse:") else 0


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: cannot read {path}: {err}") from None


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.0f}{unit}" if abs(value) >= 100 else f"{value:.2f}{unit}"


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
