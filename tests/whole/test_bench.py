"""The benchmark suite runs on a CPU, marks the GPU parts as not run, and ends with its table."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from bench.workload import Images, PlainClassifier
from gpu_busy.syncs import detect_syncs
from tests.conftest import HANG_S, ROOT


def test_the_plain_arm_is_what_a_first_setup_does():
    """float32 images augmented on the host, and a step that reads the loss back."""
    image, label = Images(train_size=4, host_augment=True).train_set[0]
    assert image.dtype == torch.float32 and image.shape == (3, 32, 32)
    model = PlainClassifier(width=4)
    model.log = lambda *args, **kwargs: None  # no Trainer here
    with detect_syncs(device_type="cpu") as rec:
        model.training_step((image[None], torch.tensor([label])), 0)
    assert any(e.op.startswith("Tensor.item") for e in rec.events)


@pytest.mark.slow
def test_quick_suite_runs_on_the_cpu_without_the_example_and_ends_with_its_table(tmp_path):
    """In a copy of the project whose example model and data are deleted: the benchmarks
    bring their own. The parts whose results are checked here; overhead and detector_cost
    fit bench.workload through the same bench.syncs.fit as end_to_end, the start-up's
    config is checked below, and CI's run of README's `make bench QUICK=1` runs every part
    in the project itself."""
    project = tmp_path / "project"
    listed = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    tracked = subprocess.run(listed, cwd=ROOT, capture_output=True, text=True)
    for name in tracked.stdout.splitlines():
        if name.startswith(("template/models/", "template/data/")) or not (ROOT / name).is_file():
            continue
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, project / name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    parts = "end_to_end,prefetch,idle_accuracy,host"
    command = [sys.executable, "-m", "bench", "--quick", "--device", "cpu"]
    done = subprocess.run(
        [*command, "--out", str(tmp_path), "--only", parts],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    table = done.stdout[done.stdout.index("claim ") :].splitlines()
    assert table[0].split() == ["claim", "measured", "goal"]
    rows = "\n".join(table)
    assert "2 prefetch" in rows and "3 idle error" in rows and rows.count("not run (no GPU)") == 2
    (saved,) = tmp_path.glob("bench-*.json")  # named by its parts
    results = json.loads(saved.read_text())
    assert results["prefetch"] == results["idle_accuracy"] == "not run (no GPU)"
    e2e = results["end_to_end"]["synthetic"]
    # The template's step reads nothing back between logging steps; the plain one does.
    assert e2e["syncs"]["template"]["steady_syncs_per_batch"] == 0
    assert e2e["syncs"]["plain"]["steady_syncs_per_batch"] >= 1
    # The host cost: every default callback (and the plugin's save) timed, on the CPU.
    host = results["host"]
    assert {"SyncPointDetector", "StepClock", "BackgroundCheckpointIO"} <= set(
        host["per_callback"]["rows"]
    )
    assert host["loop"]["step_ms"]["lightning"] > host["loop"]["step_ms"]["plain"] > 0
    assert "default callbacks' host cost" in rows
    assert results["machine"]["command"].startswith("python -m bench")
    # the fits' reports stay out of the project (they were once committed from its root)
    assert not [p.name for p in project.iterdir() if p.suffix in (".json", ".png")]


def test_the_start_up_benchmark_launches_the_package_cli_on_its_own_workload(tmp_path):
    """What part 5 runs: `python -m gpu_busy.cli fit` (not template.train) over a config of
    the default trainer and callbacks with bench.workload's model and data, so it needs
    nothing of the example."""
    import yaml

    from bench import startup

    for ddp in (False, True):
        argv, kind = startup.command(ddp, str(tmp_path))
        assert argv[1:4] == ["-m", "gpu_busy.cli", "fit"], argv
        written = (tmp_path / "startup.yaml").read_text()
        config = yaml.safe_load(written)
        assert config["model"]["class_path"] == "bench.workload.Classifier"
        assert config["data"]["class_path"] == "bench.workload.Images"
        assert "template." not in written and config["gpu_busy"]["monitor"], written
    assert "2" in kind


def test_a_table_of_the_parts_run_alone_has_their_rows_only():
    """python -m bench --only host: the host cost's row, no other part's."""
    from bench.__main__ import PARTS, main, summary

    host = {"loop": {"fastest_ours_ms": 0.1, "fastest_ratio": 1.1, "ratio": 1.1,
                     "ratio_each": [1.05, 1.15]}}  # fmt: skip
    table = summary({"host": host, "machine": {}}, "cpu")
    assert len(table) == 2 and "default callbacks' host cost (cpu)" in table[1], table
    with pytest.raises(SystemExit):  # a part that does not exist: argparse's one line
        main(["--only", "host,nope"])
    assert "startup" in PARTS
