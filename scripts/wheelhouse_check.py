"""Prove the wheelhouse a GPU machine without network installs from (``make wheelhouse``),
on this machine: build it for this Python, install the project from it into a fresh venv
with ``--no-index``, and run the entry point once.

The fresh venv sees only what a lent GPU machine has (torch, torchvision and CUDA's
libraries, taken from this project's ``.venv``); everything else must come from the
wheelhouse, build requirements included (setuptools, wheel). CI runs it (``.ci/run``).

    python scripts/wheelhouse_check.py [work dir]
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What a lent GPU machine has installed (and what is too large to carry): left out of the
# wheelhouse, taken from .venv here.
MACHINE_HAS = r"torch|torchvision|triton|nvidia-.*|cuda-.*"


def preinstalled(into: Path) -> Path:
    """A folder holding links to .venv's installed MACHINE_HAS distributions, whole."""
    into.mkdir(parents=True)
    for dist in metadata.distributions():
        if not re.fullmatch(MACHINE_HAS, dist.metadata["Name"].lower()):
            continue
        base = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or ()}
        for top in tops - {".."}:
            if (base / top).exists() and not (into / top).exists():
                (into / top).symlink_to(base / top)
    return into


def main(work: Path) -> int:
    wheels = work / "wheels"
    subprocess.run(["make", "-C", str(ROOT), "wheelhouse", f"WHEELHOUSE={wheels}",
                    f"SKIP={MACHINE_HAS}"], check=True)  # fmt: skip
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "machine_has.pth").write_text(f"{preinstalled(work / 'machine')}\n")
    offline = ["--no-index", "--find-links", str(wheels)]
    subprocess.run([python, "-m", "pip", "install", "--quiet", *offline, "-e",
                    f"{ROOT}[template]"], check=True)  # fmt: skip
    fit = subprocess.run(
        [python, "-m", "template.train", "fit", "--config", "configs/default.yaml",
         "--config", "configs/debug.yaml", f"--trainer.logger.init_args.save_dir={work}/runs"],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    done = [line for line in fit.stderr.splitlines() if "fit done in" in line]
    if fit.returncode != 0 or not done:
        print(fit.stderr[-3000:], file=sys.stderr)
        print(f"wheelhouse check FAILED: the entry point exited {fit.returncode}")
        return 1
    count = len(list(wheels.glob("*.whl")))
    print(f"wheelhouse check: {count} wheels installed offline into a fresh venv; {done[0]}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(main(Path(sys.argv[1])))
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as folder:
        sys.exit(main(Path(folder)))
