"""``make test`` and ``make test-quick``: the suite in one command, with one exit status.

Without CUDA, every test runs in pytest-xdist workers, one per core and one more for the
whole suite (the GPU tests skip).
With CUDA (a GPU runner), the CPU tests run in the workers first, then the GPU tests alone
in one process: they time the device and the host that feeds it, and a worker's load would
be in their figures.

    python scripts/run_tests.py [--quick] [--workers N|auto] [pytest arguments ...]

``GPU_BUSY_TESTS_CUDA=1`` (or 0) stands in for the CUDA check, so the split is tested on a
machine without a GPU (tests/contracts/test_packages_and_contracts.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

NO_TESTS = 5  # pytest's exit status when a selection holds no test


def cuda_present() -> bool:
    given = os.environ.get("GPU_BUSY_TESTS_CUDA")
    if given is not None:
        return given == "1"
    import torch

    return torch.cuda.is_available()


def workers(asked: str, quick: bool) -> str:
    """One per core; one more for the whole suite, whose slow tests spend part of their time
    waiting on the processes they start (DDP ranks meeting, a signal's round, a save), time
    a further worker fills: 5:27 with three workers against 6:09 with two on the 2-core CI
    machine, back to back. The quick tier is busy throughout (54 s with two, 58 s three)."""
    if asked != "auto":
        return asked
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return str(cores if quick else cores + 1)


def run(label: str, command: list[str]) -> int:
    print(f"{label}: {' '.join(command[2:])}", flush=True)
    return subprocess.call(command)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="leave out the slow tests")
    parser.add_argument("--workers", default="auto", help="xdist workers for the CPU tests")
    args, pytest_args = parser.parse_known_args(argv)
    pytest = [sys.executable, "-m", "pytest"]
    quick = " and not slow" if args.quick else ""
    parallel = ["-n", workers(args.workers, args.quick), "--dist", "worksteal"]
    if not cuda_present():
        marks = ["-m", "not slow"] if args.quick else []
        return run("tests", [*pytest, *parallel, *marks, *pytest_args])
    cpu = run("CPU tests in workers", [*pytest, *parallel, "-m", f"not gpu{quick}", *pytest_args])
    gpu = run("GPU tests in one process", [*pytest, "-p", "no:xdist", "-m", f"gpu{quick}",
                                           *pytest_args])  # fmt: skip
    if cpu == gpu == NO_TESTS:
        return NO_TESTS
    return next((code for code in (cpu, gpu) if code not in (0, NO_TESTS)), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
