"""``make test`` and ``make test-all``: a tier of the suite in one command, with one exit status.

``make test`` runs the user's tier (tests/tiers.py: what a change to ``template/`` or
``configs/`` can break); ``--all`` (``make test-all``) the whole suite. Without CUDA, the
tests run in pytest-xdist workers, one per core and one more (the GPU tests skip). With
CUDA (a GPU runner), the CPU tests run in the workers first, then every GPU test of the
suite, in either tier, alone in one process: they time the device and the host that feeds
it, and a worker's load would be in their figures.

    python scripts/run_tests.py [--all] [--workers N|auto] [pytest arguments ...]

A path among the pytest arguments runs that path instead of the tier's files.
``GPU_BUSY_TESTS_CUDA=1`` (or 0) stands in for the CUDA check, so the split is tested on a
machine without a GPU (tests/contracts/test_packages_and_contracts.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NO_TESTS = 5  # pytest's exit status when a selection holds no test


def cuda_present() -> bool:
    given = os.environ.get("GPU_BUSY_TESTS_CUDA")
    if given is not None:
        return given == "1"
    import torch

    return torch.cuda.is_available()


def workers(asked: str) -> str:
    """One per core and one more: the slow tests spend part of their time waiting on the
    processes they start (DDP ranks meeting, a signal's round, a save), time a further
    worker fills (docs/BENCHMARKS.md, "Commands")."""
    if asked != "auto":
        return asked
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return str(cores + 1)


def user_tier(pytest_args: list[str]) -> list[str]:
    """The user's tier's files, unless the arguments name a path of their own."""
    if any(not a.startswith("-") and Path(a.split("::")[0]).exists() for a in pytest_args):
        return []
    sys.path.insert(0, str(ROOT))
    from tests.tiers import USER

    return [str(ROOT / name) for name in USER]


def run(label: str, command: list[str]) -> int:
    print(f"{label}: {' '.join(command[2:])}", flush=True)
    return subprocess.call(command)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="the whole suite, both tiers")
    parser.add_argument("--workers", default="auto", help="xdist workers for the CPU tests")
    args, pytest_args = parser.parse_known_args(argv)
    pytest = [sys.executable, "-m", "pytest"]
    files = [] if args.all else user_tier(pytest_args)
    parallel = ["-n", workers(args.workers), "--dist", "worksteal"]
    if not cuda_present():
        return run("tests", [*pytest, *parallel, *pytest_args, *files])
    cpu = run("CPU tests in workers", [*pytest, *parallel, "-m", "not gpu", *pytest_args, *files])
    gpu = run("GPU tests in one process", [*pytest, "-p", "no:xdist", "-m", "gpu", *pytest_args])
    if cpu == gpu == NO_TESTS:
        return NO_TESTS
    return next((code for code in (cpu, gpu) if code not in (0, NO_TESTS)), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
