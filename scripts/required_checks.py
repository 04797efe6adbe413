"""The GPU suite's last line: how many required checks ran, and whether any skipped.

Every GPU test (a pytest JUnit XML) and every benchmark part (its log) is required: a
skip, or a part that says "not run", makes the exit status 1, as a failure does.

    python scripts/required_checks.py runs/gpu_suite/gpu_tests.xml runs/gpu_suite/bench.txt
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main(junit: str, bench_log: str) -> int:
    path = Path(junit)
    cases = list(ET.parse(path).getroot().iter("testcase")) if path.is_file() else []
    skipped = [c for c in cases if c.find("skipped") is not None]
    log = Path(bench_log)
    not_run = (
        [line.strip() for line in log.read_text().splitlines() if "not run" in line]
        if (log.is_file())
        else ["the benchmark wrote no log"]
    )
    for c in skipped:
        reason = c.find("skipped").get("message", "")
        print(f"skipped: {c.get('classname')}::{c.get('name')}: {reason}")
    for line in not_run:
        print(f"not run: {line}")
    ran, missed = len(cases) - len(skipped), len(skipped) + len(not_run)
    print(f"required GPU checks: {ran} run, {missed} skipped")
    return 1 if skipped or not_run or not cases else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
