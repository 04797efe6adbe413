"""A library is a library wherever it is installed: a package ``pip install --target``
put on ``PYTHONPATH``, outside any ``site-packages``, is not the user's code, and a sync
inside it is named at the user's line that called it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import ROOT

SCRIPT = """
import torch
from gpu_busy.syncs import detect_syncs
from gpu_busy.syncs.attribution import is_library
import fakelib

x = torch.ones(3, device=torch.ones(1).device)  # device memory, in the simulation
with detect_syncs(device_type="cpu") as rec:
    total = fakelib.total(x)  # the user's line
print(is_library(fakelib.__file__), [e.location for e in rec.events])
"""


def _installed_with_target(folder) -> None:
    """What ``pip install --target folder fakelib`` leaves: the package and its metadata."""
    (folder / "fakelib").mkdir(parents=True)
    (folder / "fakelib" / "__init__.py").write_text("def total(x):\n    return x.sum().item()\n")
    info = folder / "fakelib-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakelib\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("fakelib\n")
    (info / "RECORD").write_text("fakelib/__init__.py,,\nfakelib-1.0.dist-info/METADATA,,\n")


def _run(tmp_path, libs) -> str:
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    (project / "train.py").write_text(textwrap.dedent(SCRIPT))
    env = {"PYTHONPATH": f"{ROOT}:{libs}", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "train.py"], cwd=project, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def test_a_package_installed_on_pythonpath_is_a_library_and_the_users_line_is_named(tmp_path):
    libs = tmp_path / "libs"
    _installed_with_target(libs)
    assert _run(tmp_path, libs) == "True ['train.py:9']"


def test_a_checkout_without_metadata_on_pythonpath_stays_the_users_code(tmp_path):
    libs = tmp_path / "checkout"
    _installed_with_target(libs)
    for info in libs.glob("*.dist-info"):
        for f in info.iterdir():
            f.unlink()
        info.rmdir()
    said = _run(tmp_path, libs)
    assert said.startswith("False [") and "fakelib/__init__.py:2" in said, said
