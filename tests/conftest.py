from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
DEFAULT = str(CONFIGS / "default.yaml")
DEBUG = str(CONFIGS / "debug.yaml")
# A subprocess's time limit: it catches a hang, not a slow machine. A loaded 2-core CI
# machine runs a subprocess fit several times slower than an idle one.
HANG_S = 1800

# Under `make test` the suite runs in several worker processes (pytest-xdist), about one per core.
# Its fits are tiny models on which a second intra-op thread only spin-waits: with two
# workers on 2 cores, two threads each more than doubled the wall time (196 s serial, 317 s
# two workers of two threads, 106 s two workers of one). The variable reaches the fits a
# test starts as subprocesses (DDP ranks too).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def needs_cli():
    """Skip the calling module where the entry point cannot be imported: a GPU machine with
    torch and lightning but not jsonargparse. Everything else still runs there."""
    try:
        import jsonargparse  # noqa: F401
    except ImportError:
        pytest.skip("the entry point (LightningCLI) needs jsonargparse", allow_module_level=True)


def cli_main():
    """``gpu_busy.cli.main``, or a clean skip where the entry point cannot be imported."""
    needs_cli()
    from gpu_busy.cli import main

    return main


def pytest_configure(config):
    # Installed, the no_syncs plugin is registered by its pytest11 entry point; from a bare
    # checkout (a GPU machine with torch but without this project installed) load it here.
    if not config.pluginmanager.hasplugin("gpu_busy"):
        config.pluginmanager.import_plugin("pytest_gpu_busy")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent from a bare GPU machine
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: no workers where CUDA is present, since the GPU tests time the device and
    the host that feeds it, and a second worker's load would be in their figures. Elsewhere
    xdist's own count (the cores)."""
    if torch.cuda.is_available():
        return 0
    return None


def pytest_report_header(config):
    """The stack the tests run on, once at the top of the run."""
    from importlib.metadata import PackageNotFoundError, version

    names = ("torch", "lightning", "torchmetrics", "torchvision", "jsonargparse")
    found = []
    for name in names:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return "stack: " + ", ".join(found)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def write_cifar10(root: Path, per_batch: int = 20, seed: int = 0) -> dict[str, np.ndarray]:
    """Write a tiny CIFAR-10 in its own on-disk format; returns the arrays written."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    written = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = [int(x) for x in rng.integers(0, 10, size=per_batch)]
        entry = {b"batch_label": name.encode(), b"labels": labels, b"data": data}
        with (folder / name).open("wb") as f:
            pickle.dump(entry, f)
        written[name] = (data, labels)
    with (folder / "batches.meta").open("wb") as f:
        pickle.dump({b"label_names": [b"c%d" % i for i in range(10)]}, f)
    return written


@pytest.fixture
def cifar_root(tmp_path: Path) -> tuple[Path, dict]:
    root = tmp_path / "cifar"
    return root, write_cifar10(root)


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    """data/train/<class>/*.png and data/val/<class>/*.png with images of varied sizes."""
    from PIL import Image

    root = tmp_path / "images"
    g = torch.Generator().manual_seed(0)
    for split, count in (("train", 6), ("val", 2)):
        for cls in ("cats", "dogs", "owls"):
            (root / split / cls).mkdir(parents=True)
            for i in range(count):
                h, w = 20 + 7 * i, 40 - 3 * i
                pixels = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g)
                Image.fromarray(pixels.numpy()).save(root / split / cls / f"{i}.png")
    return root


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch) -> Path:
    """Run in a temporary directory so runs/ and data/ land there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_entry_point(
    args: list[str],
    cwd: Path,
    timeout: float = HANG_S,
    env: dict | None = None,
    new_session: bool = False,
):
    """Run ``python -m template.train`` as a user would; returns the CompletedProcess.
    ``new_session``: in a process group of its own, which the run may signal whole."""
    needs_cli()
    return subprocess.run(
        [sys.executable, "-m", "template.train", *args],
        cwd=cwd,
        env=project_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=new_session,
    )


ADDED = "gpu_busy: added"  # the launcher's first line, once a Trainer has the set


def project_env(**extra: str) -> dict[str, str]:
    """This environment with the project importable first, then what the caller's path held
    (packages carried to a machine), output unbuffered, and ``extra``."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def launcher_env(**extra: str) -> dict[str, str]:
    """``project_env`` for ``python -m gpu_busy run``, without the options or rank
    variables this run may hold."""
    env = project_env(**extra)
    for name in ("GPU_BUSY_STRICT_SYNCS", "GPU_BUSY_MONITOR", "LOCAL_RANK", "RANK"):
        if name not in extra:
            env.pop(name, None)
    return env


def run_launcher(args: list[str], cwd: Path, **env: str):
    """``python -m gpu_busy run ARGS``, in ``cwd``, with ``env`` added."""
    command = [sys.executable, "-m", "gpu_busy", "run", *args]
    return subprocess.run(command, cwd=cwd, env=launcher_env(**env), capture_output=True,
                          text=True, timeout=HANG_S)  # fmt: skip


_REPORTS = ("run.json", "syncs.json", "idle.json", "idle.png", "throughput.json", "prefetch.json")


@pytest.fixture(autouse=True)
def _no_reports_in_the_repository(request):
    """A Trainer without a logger writes its reports to ``default_root_dir`` (the working
    directory where none is given): a test's fit must give one, never the repository."""
    before = {name: (ROOT / name).stat().st_mtime_ns for name in _REPORTS if (ROOT / name).exists()}
    yield
    after = {name: (ROOT / name).stat().st_mtime_ns for name in _REPORTS if (ROOT / name).exists()}
    written = sorted(name for name, t in after.items() if before.get(name) != t)
    assert not written, (
        f"{written} written into the repository during {request.node.nodeid} (under workers,"
        " maybe by another test running beside it)"
    )
