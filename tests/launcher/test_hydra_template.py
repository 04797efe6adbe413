"""lightning-hydra-template's own ``src/train.py`` under ``python -m gpu_busy run``.

``lightning_hydra_template/`` holds its ``src/``, ``configs/`` and ``.project-root`` exactly as
the template ships them (ashleve/lightning-hydra-template at commit bddbc24b; its MIT
licence, from its README, in ``LICENSE``); the
MNIST files its datamodule reads are written small and random where torchvision looks.
``rootutils`` is ``scripts/standins/rootutils.py``. Its Trainer has no logger by default
(``logger: null``): the reports go to its ``default_root_dir``, Hydra's output folder of
the run. Needs the ``hydra`` extra (``.ci/run`` installs it), and skips without it.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ADDED, HANG_S
from tests.conftest import launcher_env as _env

pytest.importorskip("hydra", reason="the hydra extra: pip install -e '.[hydra]'")
pytest.importorskip("rich", reason="the hydra extra: pip install -e '.[hydra]'")

TEMPLATE = Path(__file__).parent / "lightning_hydra_template"
STANDINS = Path(__file__).parent / "scripts" / "standins"
# a short fit: 150 of the 200 images written below train, 30 validate, 20 would test (the
# template's own test loads its best checkpoint with a pickled module, which torch >= 2.6
# refuses by default: plain runs fail there too)
SHORT = ["trainer.max_epochs=1", "data.train_val_test_split=[150,30,20]", "data.batch_size=16",
         "seed=1", "test=False"]  # fmt: skip


def _template(tmp_path: Path) -> Path:
    """The template copied unchanged, with the MNIST idx files its datamodule reads."""
    root = tmp_path / "template"
    shutil.copytree(TEMPLATE, root)
    raw = root / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for prefix, n in (("train", 160), ("t10k", 40)):
        images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, 10, (n,), dtype=torch.uint8, generator=g)
        head = struct.pack(">IIII", 0x803, n, 28, 28)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(head + images.numpy().tobytes())
        head = struct.pack(">II", 0x801, n)
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(head + labels.numpy().tobytes())
    return root


@pytest.mark.slow
@pytest.mark.parametrize(
    "trainer",
    [["trainer=cpu"], ["trainer=ddp_sim"],
     # Lightning's DDP launcher restarts a Hydra app through _hydra_subprocess_cmd
     ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
      "trainer.sync_batchnorm=False"]],
    ids=["one process", "ddp_sim", "ddp"],
)  # fmt: skip
def test_the_templates_train_py_runs_unchanged_with_the_set_on_every_rank(tmp_path, trainer):
    root = _template(tmp_path)
    command = [sys.executable, "-m", "gpu_busy", "run", "src/train.py", *trainer, *SHORT]
    env = _env()
    env["PYTHONPATH"] += os.pathsep + str(STANDINS)
    ran = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True,
                         timeout=HANG_S)  # fmt: skip
    out = ran.stdout + ran.stderr
    assert ran.returncode == 0, out[-3000:]
    # one Trainer, the set on each rank (a rank without it ends the run at set-up), one report
    assert out.count(ADDED) == 1 and out.count("fit done") == 1, out[-3000:]
    ranks = 1 if trainer == ["trainer=cpu"] else 2
    assert f"over {ranks} process(es)" in out, out[-3000:]
    assert "(no logger: the reports go to default_root_dir)" in out, out[-3000:]
    reports = list(root.glob("logs/train/runs/*/run.json"))
    assert len(reports) == 1 and (reports[0].parent / "syncs.json").is_file(), out[-3000:]
