"""Run every command README.md shows in its ``bash`` blocks, in order, as a user would.

CI runs this after ``make test`` on a fresh clone (``.ci/run``), so a command README
shows cannot rot. Lines run one at a time in bash from the project root; a ``NAME=value``
line is kept for the lines after it. ``make test`` and ``make test-all`` are CI's own steps. A
command that asks for more GPUs than the machine has (``GPUS=N``) must fail the way
README says: before any process starts, with one ``error:`` line. ``make compare`` fails
when B fails a gate, which is a finding, not a failure of the command: its last line
says which (``ok:``, ``better:`` or ``worse:``).

Example::

    python scripts/readme_commands.py            # every command; stops at the first failure
    python scripts/readme_commands.py --list     # only print them
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = {"make test", "make test-all"}  # CI's own steps, timed around this one


def commands(text: str) -> list[str]:
    """The command lines of README's ``bash`` blocks, comments cut."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def gpus_missing(line: str) -> int | None:
    """The GPUs a ``GPUS=N`` line asks for beyond those visible, or None."""
    found = re.search(r"\bGPUS=(\d+)", line)
    if not found:
        return None
    visible = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return int(found.group(1)) if int(visible) < int(found.group(1)) else None


def main(argv: list[str]) -> int:
    lines = commands((ROOT / "README.md").read_text())
    if "--list" in argv:
        print("\n".join(lines))
        return 0
    assignments: list[str] = []
    for line in lines:
        if re.fullmatch(r"[A-Z_]+=\S+", line):
            assignments.append(line)
            continue
        if line in SKIP:
            print(f"== {line}: run by CI before this", flush=True)
            continue
        print(f"== {line}", flush=True)
        start = time.monotonic()
        done = subprocess.run(
            ["bash", "-c", "\n".join([*assignments, line])],
            cwd=ROOT, capture_output=True, text=True,
        )  # fmt: skip
        seconds = time.monotonic() - start
        errors = [x for x in done.stderr.splitlines() if x.startswith("error:")]
        last = (done.stdout.strip().splitlines() or [""])[-1]
        if gpus_missing(line) is not None:
            ok = done.returncode != 0 and len(errors) == 1 and "Traceback" not in done.stderr
            outcome = f"refused as README says: {errors[0] if errors else '(no error line)'}"
        elif line.startswith("make compare"):
            ok = last.startswith(("ok:", "better:", "worse:")) and "Traceback" not in done.stderr
            outcome = f"exit {done.returncode}: {last}"
        else:
            ok = done.returncode == 0
            outcome = f"exit {done.returncode}"
        print(f"   {outcome}, {seconds:.0f} s", flush=True)
        if not ok:
            print((done.stdout + done.stderr)[-4000:], file=sys.stderr)
            print(f"error: README's command failed: {line}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
