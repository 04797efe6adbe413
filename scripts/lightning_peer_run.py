"""Lightning's own tests, run twice: plain, and with the default set on every Trainer (as
``python -m gpu_busy run`` gives it). Prints how many tests end each way and every test
that passes plain and not with the set, with the first line of why.

    git clone --branch 2.6.5 --depth 1 https://github.com/Lightning-AI/pytorch-lightning /tmp/pl
    python scripts/lightning_peer_run.py /tmp/pl loggers callbacks checkpointing trainer

The folders are under ``tests/tests_pytorch``. Each run writes a JUnit file to ``--out``.
What differs by design is listed in docs/ARCHITECTURE.md, "Lightning's own tests".
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """Each test's outcome (passed, failed, error, skipped) and the first line of why."""
    found = {}
    for case in ET.parse(junit).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kind, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                kind = "failed" if tag == "failure" else tag
                why = (element.get("message") or element.text or "").strip().splitlines()[:1]
                why = why[0][:200] if why else ""
                break
        found[name] = (kind, why)
    return found


def run(lightning: Path, folders: list[str], out: Path, with_set: bool, workers: str) -> Path:
    junit = out / ("with_set.xml" if with_set else "plain.xml")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-m", "pytest", *[f"tests_pytorch/{f}" for f in folders],
               "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", "-n", workers,
               *(["-p", "tests.helpers.lightning_peer_plugin"] if with_set else [])]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": path}
    subprocess.run(command, cwd=lightning / "tests", env=env, stdout=subprocess.DEVNULL)
    return junit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lightning", type=Path, help="a checkout of pytorch-lightning")
    parser.add_argument("folders", nargs="+", help="under tests/tests_pytorch")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "peer")
    parser.add_argument("--workers", default="2", help="pytest-xdist workers")
    args = parser.parse_args(argv)
    if not (args.lightning / "tests" / "tests_pytorch").is_dir():
        print(f"error: {args.lightning} has no tests/tests_pytorch: give a checkout of "
              "pytorch-lightning", file=sys.stderr)  # fmt: skip
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    plain, ours = (outcomes(run(args.lightning, args.folders, args.out, s, args.workers))
                   for s in (False, True))  # fmt: skip
    for name, found in (("plain", plain), ("with the set", ours)):
        counts = collections.Counter(kind for kind, _ in found.values())
        print(
            f"{name}: {len(found)} tests, "
            + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        )
    differ = sorted(
        t
        for t, (kind, _) in plain.items()
        if kind == "passed" and ours.get(t, ("missing",))[0] != "passed"
    )
    print(f"pass plain, not with the set: {len(differ)}")
    for test in differ:
        kind, why = ours.get(test, ("missing", ""))
        print(f"  {test}: {kind}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
