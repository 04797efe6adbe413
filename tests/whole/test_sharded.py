"""Sharded training (FSDP2 through configs/fsdp.yaml): the real entry point, 2 CPU ranks
(gloo), every callback of the default config checked under sharding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from gpu_busy.throughput.flops import FlopCount
from template.models import cifar_resnet
from tests.conftest import CONFIGS, DEBUG, DEFAULT, run_entry_point

FSDP = str(CONFIGS / "fsdp.yaml")


def strict_callbacks(tmp_path: Path) -> str:
    """The default config's callbacks, the sync detector strict on every step, and a probe
    of what each rank holds: an overlay file (a list in a later config replaces it)."""
    callbacks = yaml.safe_load(Path(DEFAULT).read_text())["trainer"]["callbacks"]
    for spec in callbacks:
        if spec["class_path"].endswith("SyncPointDetector"):
            spec["init_args"] = {"strict": True, "first_steps": 1000}
    callbacks.append({"class_path": "tests.helpers.sharded_probe.RecordParameters"})
    overlay = tmp_path / "strict.yaml"
    overlay.write_text(yaml.safe_dump({"trainer": {"callbacks": callbacks}}))
    return str(overlay)


@pytest.mark.slow
def test_two_sharded_ranks_train_with_every_callback_true_and_one_report(tmp_path):
    result = run_entry_point(
        [
            "fit", "--config", DEFAULT, "--config", DEBUG, "--config", FSDP,
            "--config", strict_callbacks(tmp_path),
            "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_epochs=2",
            "--data.synthetic_train_size=512", "--data.batch_size=32",
            "--trainer.limit_train_batches=8", "--trainer.log_every_n_steps=4",
        ],
        cwd=tmp_path,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    run = tmp_path / "runs" / "fsdp" / "version_0"

    # Sharded: every parameter a DTensor over both ranks, each rank holding about half.
    held = [json.loads((tmp_path / "shards" / f"params_rank{r}.json").read_text()) for r in (0, 1)]
    assert all(h["all_dtensors"] and h["mesh_sizes"] == [2] for h in held), held
    assert held[0]["full"] == held[1]["full"] == held[0]["local"] + held[1]["local"]
    assert max(h["local"] for h in held) < 0.52 * held[0]["full"], held

    # One report, by rank zero, from both ranks' figures.
    for line in ("run directory", "throughput:", "verdict:", "sync points:", "idle time:",
                 "fit done in"):  # fmt: skip
        assert output.count(line) == 1, line
    assert "over 2 process(es)" in output
    # The prefetcher delivered every rank's batches: 8 a rank in each of 2 epochs.
    assert output.count("prefetch: 32 batches") == 1
    # The sync detector watched every step, strict: FSDP's all-gathers and reduce-scatters
    # are collectives, not host reads; a steady sync would have failed the run.
    syncs = json.loads((run / "syncs.json").read_text())
    assert syncs["summary"]["steady_watched_batches"] >= 8
    assert [s for s in syncs["sites"] if s["steady_count"] and not s["allowed"]] == []
    # Idle time from both ranks.
    idle = json.loads((run / "idle.json").read_text())
    assert idle["world_size"] == 2 and [r["rank"] for r in idle["ranks"]] == [0, 1]
    # Throughput counts the whole model's FLOPs once: what one unsharded batch costs.
    throughput = json.loads((run / "throughput.json").read_text())
    net, count = cifar_resnet(10, width=8), FlopCount()
    loss = count.around(lambda x: F.cross_entropy(net(x), torch.zeros(32, dtype=torch.long)))(
        torch.randn(32, 3, 32, 32)
    )
    count.around(loss.backward)()
    assert throughput["world_size"] == 2 and throughput["flops_per_batch"] == count.flops
    # Checkpoints: a torch.distributed.checkpoint folder, a file per rank, none gathered.
    last = run / "checkpoints" / "last.ckpt"
    assert last.is_dir()
    assert {p.name for p in last.iterdir()} >= {".metadata", "meta.pt", "__0_0.distcp",
                                                "__1_0.distcp"}  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "runs" / "fsdp").iterdir()) == ["version_0"]


def test_the_sharded_strategy_puts_every_rank_in_the_data_parallel_dimension():
    from gpu_busy.strategies import FullyShardedStrategy

    strategy = FullyShardedStrategy()
    assert strategy._tensor_parallel_size == 1  # the parent's "auto" would be every GPU
    with pytest.raises(TypeError, match="sets tensor_parallel_size itself"):
        FullyShardedStrategy(tensor_parallel_size=2)
