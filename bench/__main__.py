"""The benchmark suite: every claim of the template measured side by side, in one run.

    python -m bench [--quick] [--out DIR] [--device auto|cpu|cuda]      (or: make bench)

1. end to end: the template's default training against a plain first setup
   (``bench.end_to_end``): images/s, idle share, syncs per step;
2. prefetch overlap on a transfer-heavy workload (``bench.prefetch``; GPU only);
3. idle-time accuracy against injected host delays (``bench.idle``; GPU only);
4. overhead: every template callback on vs off (``bench.idle``), the sync detector's
   watched-step and amortised cost (``bench.syncs``), and the default callbacks' host cost
   per step on a near-free model, per callback (``bench.host``);
5. start-up: the command line to the first training step, one process and DDP
   (``bench.startup``).

On a machine without CUDA the GPU parts are marked "not run". ``--quick`` runs fewer
steps and repeats (under two minutes on a 2-core CPU): a smoke test of the suite, not
figures to quote. Full results go to ``DIR/bench.json``; the output ends with one table.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

from bench import end_to_end, host, idle, prefetch, startup, syncs
from bench.results import add_device_option, chosen_device, machine, save

# steps, repeats per part: (quick, full) x (cpu, cuda)
PLAN = {
    ("quick", "cpu"): {
        "e2e": (20, 1),
        "overhead": (30, 1),
        "detector": (30, 1),
        "host": (100, 1),
        "startup": 1,
    },
    ("full", "cpu"): {
        "e2e": (60, 3),
        "overhead": (100, 5),
        "detector": (150, 3),
        "host": (400, 7),
        "startup": 3,
    },
    ("quick", "cuda"): {
        "e2e": (40, 1),
        "overhead": (60, 1),
        "detector": (60, 1),
        "host": (100, 1),
        "startup": 1,
    },
    ("full", "cuda"): {
        "e2e": (150, 3),
        "overhead": (150, 3),
        "detector": (150, 3),
        "host": (400, 7),
        "startup": 2,
    },
}
NOT_RUN = "not run (no GPU)"


PARTS = ("end_to_end", "prefetch", "idle_accuracy", "overhead", "detector_cost", "host", "startup")


def run(device: str, quick: bool, log, only: set[str] | None = None) -> dict:
    plan = PLAN["quick" if quick else "full", device]
    cuda = device == "cuda"
    results: dict = {}
    parts = [
        ("end_to_end", lambda: end_to_end.run(device, *plan["e2e"], sync_steps=plan["e2e"][0])),
        (
            "prefetch",
            (lambda: prefetch.run(20 if quick else 40, 1 if quick else 3)) if cuda else None,
        ),
        (
            "idle_accuracy",
            (lambda: idle.injected_delays(torch.device("cuda"), steps=15 if quick else 30))
            if cuda
            else None,
        ),
        ("overhead", lambda: idle.overhead(device, *plan["overhead"])),
        ("detector_cost", lambda: syncs.measure_cost(device, *plan["detector"])),
        ("host", lambda: host.run(*plan["host"], device)),
        (
            "startup",
            (lambda: startup.run(plan["startup"]))
            if importlib.util.find_spec("jsonargparse")
            else "not run (the entry point needs jsonargparse)",
        ),
    ]
    for name, part in parts:
        if only is not None and name not in only:
            continue
        if part is None or isinstance(part, str):
            results[name] = part or NOT_RUN
            continue
        t0 = time.perf_counter()
        log(f"bench: {name} ...")
        results[name] = part()
        log(f"bench: {name} done in {time.perf_counter() - t0:.0f} s")
    results["plan"] = {k: list(v) if isinstance(v, tuple) else v for k, v in plan.items()}
    return results


Row = tuple[str, str, str]


def _end_to_end_rows(part, device: str) -> list[Row]:
    rows: list[Row] = []
    for name, e in part.items():
        rate = e["images_per_s"]
        rows.append(
            (
                f"1 end to end ({name}): images/s",
                f"{rate['template']:.0f} vs plain {rate['plain']:.0f}: {e['speed_ratio']:.2f}x "
                f"[{min(e['speed_ratio_each']):.2f}, {max(e['speed_ratio_each']):.2f}]",
                "",
            )
        )
        clock = "" if device == "cuda" else " (host clock)"
        rows.append(
            (
                "  idle % (template / plain)",
                f"{_num(e['idle_pct']['template'], '.1f')} / "
                f"{_num(e['idle_pct']['plain'], '.1f')}{clock}",
                "template < 5 (GPU)",
            )
        )
        s = e["syncs"]
        rows.append(
            (
                "  syncs per steady step",
                f"{s['template']['steady_syncs_per_batch']:.2f} / plain "
                f"{s['plain']['steady_syncs_per_batch']:.2f}",
                "template 0",
            )
        )
    return rows


def _prefetch_rows(p, device: str) -> list[Row]:
    rows: list[Row] = []
    if isinstance(p, dict):
        w = p["workloads"]["transfer-heavy"]
        rows.append(
            ("2 prefetch step / max(copy, compute)", f"{w['prefetch_vs_bound']:.3f}", "<= 1.10")
        )
    else:
        rows.append(("2 prefetch step / max(copy, compute)", p, "<= 1.10"))
    return rows


def _idle_accuracy_rows(a, device: str) -> list[Row]:
    rows: list[Row] = []
    if isinstance(a, list):
        ev = max(abs(r["event_error_ms"]) for r in a)
        tr = max(abs(r["trace_error_ms"]) for r in a if r["trace_error_ms"] is not None)
        tol = min(r["tolerance_ms"] for r in a)
        rows.append(
            (
                "3 idle error, worst (events / trace)",
                f"{ev:.3f} / {tr:.3f} ms",
                f"<= {tol:.2f} ms",
            )
        )
    else:
        rows.append(("3 idle error, worst (events / trace)", a, "<= max(0.1 ms, 5%)"))
    return rows


def _overhead_rows(o, device: str) -> list[Row]:
    rows: list[Row] = []
    lo, hi = min(o["paired_costs"]), max(o["paired_costs"])
    rows.append(
        (
            "4 every callback on vs off",
            f"{100 * o['cost']:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}]; "
            f"{100 * o['cost_from_step_medians']:+.1f}% by step medians",
            "<= 1% (GPU)",
        )
    )
    return rows


def _detector_cost_rows(d, device: str) -> list[Row]:
    rows: list[Row] = []
    rows.append(
        (
            "  sync detector: watched step / amortised",
            f"{100 * d['watched_step_cost_from_medians']:+.0f}% / "
            f"{100 * d['amortised_cost_from_medians']:.2f}%",
            "amortised <= 1%",
        )
    )
    return rows


def _host_rows(part, device: str) -> list[Row]:
    rows: list[Row] = []
    h = part["loop"]
    rows.append(
        (
            f"  default callbacks' host cost ({device})",
            f"{h['fastest_ours_ms']:+.3f} ms/step, x{h['fastest_ratio']:.2f} of bare Lightning "
            f"(fastest fits; paired x{h['ratio']:.2f} "
            f"[{min(h['ratio_each']):.2f}, {max(h['ratio_each']):.2f}])",
            "<= x1.10",
        )
    )
    return rows


def _startup_rows(st, device: str) -> list[Row]:
    rows: list[Row] = []
    if isinstance(st, dict):
        rows.append(
            (
                "5 CLI to first step: 1 / DDP 2",
                f"{st['single']['to_first_step_s']:.1f} s / {st['ddp']['to_first_step_s']:.1f} s",
                st["ddp"]["processes"],
            )
        )
    else:
        rows.append(("5 CLI to first step: 1 / DDP 2", st, ""))
    return rows


ROWS = {
    "end_to_end": _end_to_end_rows,
    "prefetch": _prefetch_rows,
    "idle_accuracy": _idle_accuracy_rows,
    "overhead": _overhead_rows,
    "detector_cost": _detector_cost_rows,
    "host": _host_rows,
    "startup": _startup_rows,
}  # a part's rows in the table


def summary(results: dict, device: str) -> list[str]:
    """The short table: one row per claim, what was measured, the goal; the rows of the
    parts run (all, or those of ``--only``)."""
    rows = [row for name in PARTS if name in results for row in ROWS[name](results[name], device)]
    width = max(len(r[0]) for r in rows) + 2
    mid = max(len(r[1]) for r in rows) + 2
    lines = [f"{'claim':<{width}}{'measured':<{mid}}goal"]
    lines += [f"{a:<{width}}{b:<{mid}}{c}" for a, b, c in rows]
    return lines


def _num(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps: a smoke test")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"), help="results folder")
    parser.add_argument(
        "--only",
        type=lambda text: set(text.split(",")),
        help=f"these parts only, comma-separated ({', '.join(PARTS)}); the suite keeps within "
        "its time by running its parts apart (scripts/gpu_suite.sh)",
    )
    add_device_option(parser)
    args = parser.parse_args(argv)
    device = chosen_device(parser, args.device)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    results = {"machine": machine("bench", device, argv, quick=args.quick)}
    if args.only and args.only - set(PARTS):
        parser.error(f"--only: no part {sorted(args.only - set(PARTS))}; the parts: {PARTS}")
    results.update(run(device, args.quick, log, args.only))
    results["seconds"] = time.perf_counter() - t0
    name = "bench.json" if not args.only else f"bench-{'-'.join(sorted(args.only))}.json"
    save(results, args.out, name)
    m = results["machine"]
    print(
        f"\n{m['device']} ({device}); torch {m['torch']}, lightning {m['lightning']}, "
        f"python {m['python']}; {'quick' if args.quick else 'full'} run, "
        f"{results['seconds']:.0f} s; results: {args.out / name}"
    )
    print("\n".join(summary(results, device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
