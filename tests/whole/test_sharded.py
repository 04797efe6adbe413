"""Sharded training (FSDP2 through configs/fsdp.yaml): the real entry point, 2 CPU ranks
(gloo), every callback of the default config checked under sharding."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from gpu_busy.resume import checkpoint_file
from gpu_busy.throughput.flops import FlopCount
from template.models import cifar_resnet
from tests.conftest import CONFIGS, DEBUG, DEFAULT, HANG_S, ROOT, run_entry_point

FSDP = str(CONFIGS / "fsdp.yaml")


def strict_callbacks(tmp_path: Path, every_epoch: bool = False) -> str:
    """The default set, the sync detector strict on every step, and a probe of what each rank
    holds: an overlay file (a kind it lists replaces the default set's).
    ``every_epoch``: the best checkpoint kept for every epoch, not the best alone."""
    callbacks = [
        {"class_path": "gpu_busy.callbacks.SyncPointDetector",
         "init_args": {"strict": True, "first_steps": 1000}},
        {"class_path": "tests.helpers.sharded_probe.RecordParameters"},
    ]  # fmt: skip
    if every_epoch:  # both checkpoints of the default set, the best one for every epoch
        from gpu_busy.callbacks.default_set import Options, _best, _last

        best, last = _best(Options(monitor="val/acc")), _last(Options())
        callbacks += [
            {"class_path": "gpu_busy.callbacks.BestCheckpoint",
             "init_args": {"monitor": best.monitor, "mode": best.mode, "save_top_k": -1,
                           "filename": best.filename, "auto_insert_metric_name": False}},
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
             "init_args": {"filename": last.filename, "save_top_k": 1,
                           "enable_version_counter": False}},
        ]  # fmt: skip
    overlay = tmp_path / "strict.yaml"
    overlay.write_text(yaml.safe_dump({"trainer": {"callbacks": callbacks}}))
    return str(overlay)


def sharded_fit(
    folder: Path, *args: str, devices: int = 2, subcommand: str = "fit", every_epoch=False
):
    """The entry point on ``devices`` CPU ranks with the sharding overlay: 8 batches of 32
    a rank an epoch (on 2 ranks), every callback of the default config, strict."""
    result = run_entry_point(
        [
            subcommand, "--config", DEFAULT, "--config", DEBUG, "--config", FSDP,
            "--config", strict_callbacks(folder, every_epoch),
            "--trainer.accelerator=cpu", f"--trainer.devices={devices}",
            "--data.synthetic_train_size=512", "--data.batch_size=32",
            "--trainer.limit_train_batches=8", "--trainer.log_every_n_steps=4", *args,
        ],
        cwd=folder,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    return output


@pytest.fixture(scope="module")
def two_epochs(tmp_path_factory):
    """One sharded fit of 2 epochs on 2 ranks: runs/fsdp/version_0, with a checkpoint of
    each epoch's end; its output."""
    folder = tmp_path_factory.mktemp("sharded")
    return folder, sharded_fit(folder, "--trainer.max_epochs=2", every_epoch=True)


@pytest.mark.slow
def test_two_sharded_ranks_train_with_every_callback_true_and_one_report(two_epochs):
    tmp_path, output = two_epochs
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


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_exactly_on_two_ranks_and_loads_on_one(two_epochs):
    """Resumed from the first epoch's torch.distributed.checkpoint folder, the run ends
    with the weights of the one that never stopped, bit for bit. On one rank the same folder
    loads resharded: the weights it evaluates are the ones saved."""
    folder, _ = two_epochs
    runs = folder / "runs" / "fsdp"
    # version_0 is the uninterrupted run; its save at the end of epoch 0 is what a run
    # stopped there leaves (its ModelCheckpoint's save, the same callback, the same step)
    saved = runs / "version_0" / "checkpoints" / "best-epoch00.ckpt"
    assert saved.is_dir() and checkpoint_file.read_checkpoint(saved)["global_step"] == 8
    resumed = sharded_fit(folder, "--trainer.max_epochs=2", f"--ckpt_path={saved}")  # version_1
    assert f"resuming from {saved}" in resumed
    straight = torch.load(folder / "shards" / "final_0.pt", weights_only=True)
    again = torch.load(folder / "shards" / "final_1.pt", weights_only=True)
    assert straight.keys() == again.keys()
    assert all(torch.equal(straight[k], again[k]) for k in straight), [
        k for k in straight if not torch.equal(straight[k], again[k])
    ]

    # One rank: validate the same folder's weights, then train on from it.
    with (runs / "version_0" / "metrics.csv").open() as f:
        logged = [float(row["val/loss"]) for row in csv.DictReader(f) if row["val/loss"]]
    # all 128 validation images: 2 batches a rank on 2 ranks, 4 on one
    one = sharded_fit(
        folder, f"--ckpt_path={saved}", "--trainer.limit_val_batches=4",
        devices=1, subcommand="validate",
    )  # fmt: skip
    # read from the evaluation's own metrics.csv, not the console's table (which a rich
    # progress bar draws in boxes)
    (written,) = (runs / "version_0").glob("validate-*/metrics.csv")
    with written.open() as f:
        (validated,) = [float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")]
    assert validated == pytest.approx(logged[0], rel=1e-5), (validated, one[-2000:])
    trained = sharded_fit(folder, "--trainer.max_epochs=2", f"--ckpt_path={saved}", devices=1)
    assert "resumed at step 8 over 1 process(es)" in trained


@pytest.mark.slow
def test_a_sharded_save_a_rank_did_not_finish_is_never_resumed_from(two_epochs, tmp_path):
    """Saved in place over an older one: a shard newer than the index, or an index newer
    than Lightning's meta.pt, is a save that stopped part way; a whole one reads."""
    folder, _ = two_epochs
    whole = folder / "runs" / "fsdp" / "version_0" / "checkpoints" / "last.ckpt"
    assert checkpoint_file.read_checkpoint(whole)["global_step"] == 16
    for newer, than in (("__1_0.distcp", ".metadata"), (".metadata", "meta.pt")):
        copy = tmp_path / newer / "last.ckpt"
        shutil.copytree(whole, copy)
        later = (copy / than).stat().st_mtime_ns + 10**9
        os.utime(copy / newer, ns=(later, later))
        with pytest.raises(checkpoint_file.UnusableCheckpoint, match="save did not finish"):
            checkpoint_file.read_checkpoint(copy)
    (tmp_path / "gone").mkdir()
    shutil.copytree(whole, tmp_path / "gone" / "last.ckpt")
    (tmp_path / "gone" / "last.ckpt" / "__0_0.distcp").unlink()
    with pytest.raises(checkpoint_file.UnusableCheckpoint, match=r"missing __0_0\.distcp"):
        checkpoint_file.read_checkpoint(tmp_path / "gone" / "last.ckpt")


@pytest.mark.slow
def test_a_sharded_checkpoint_without_a_sharding_strategy_is_one_line(two_epochs):
    folder, _ = two_epochs
    saved = folder / "runs" / "fsdp" / "version_0" / "checkpoints" / "last.ckpt"
    result = run_entry_point(
        ["fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.accelerator=cpu",
         f"--ckpt_path={saved}"],
        cwd=folder,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert "is a sharded checkpoint" in line and "STRATEGY=fsdp" in line, line


SHARDED_DDP = ["fit", "--config", DEFAULT, "--config", DEBUG, "--config", FSDP,
               "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_epochs=2",
               "--trainer.log_every_n_steps=4"]  # fmt: skip


def _said(result) -> list[str]:
    return [x for x in result.stderr.splitlines() if x.startswith(("error:", "stopped:"))]


@pytest.mark.slow
def test_sigterm_on_one_sharded_rank_stops_both_at_one_step_with_a_whole_checkpoint(tmp_path):
    result = run_entry_point(
        [*SHARDED_DDP, "--trainer.callbacks+=tests.helpers.faults_probe.SignalAt",
         "--trainer.callbacks.init_args.step=1", "--trainer.callbacks.init_args.rank=1"],
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-3000:]
    last = Path("runs", "fsdp", "version_0", "checkpoints", "last.ckpt")
    # Rank 1 alone got the signal after step 1; the ranks agreed at the next check (step 4)
    # and every rank wrote its shard of the save.
    assert _said(result) == [
        f"stopped: SIGTERM at step 4; saved {last} (resume with --ckpt_path last)"
    ]
    saved = checkpoint_file.read_checkpoint(tmp_path / last)
    assert saved["global_step"] == 4 and len(saved["state_dict"]) > 0


@pytest.mark.slow
def test_a_failed_sharded_rank_ends_both_naming_it(tmp_path):
    result = run_entry_point(
        [*SHARDED_DDP, "--trainer.callbacks+=tests.helpers.faults_probe.FailAt",
         "--trainer.callbacks.init_args.step=2", "--trainer.callbacks.init_args.rank=1",
         "--trainer.callbacks.init_args.how=raise"],
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    (line,) = [x for x in _said(result) if x.startswith("error: rank")]
    assert line.startswith("error: rank 1 failed (RuntimeError: injected failure at step 2)")


@pytest.mark.slow
def test_two_torchrun_agents_on_loopback_train_the_sharded_example(tmp_path):
    """torchrun is the multi-node engine: two agents, one a node, rendezvous on 127.0.0.1;
    each starts one rank, and the model shards over both."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)

    def agent(node: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
             f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}",
             "-m", "template.train", "fit", "--config", DEFAULT, "--config", DEBUG,
             "--config", FSDP, "--trainer.accelerator=cpu", "--trainer.devices=1",
             "--trainer.num_nodes=2", "--trainer.max_epochs=1",
             "--trainer.callbacks+=tests.helpers.sharded_probe.RecordParameters"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    agents = [agent(0), agent(1)]
    outputs = [a.communicate(timeout=HANG_S)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert sum(o.count("fit done in") for o in outputs) == 1
    assert "over 2 process(es)" in outputs[0]
    held = [json.loads((tmp_path / "shards" / f"params_rank{r}.json").read_text()) for r in (0, 1)]
    assert all(h["mesh_sizes"] == [2] for h in held)
    assert held[0]["local"] + held[1]["local"] == held[0]["full"]


@pytest.mark.slow
def test_a_nan_loss_on_sharded_ranks_stops_both_keeping_the_last_good_save(tmp_path):
    result = run_entry_point(
        [*SHARDED_DDP, "--trainer.max_epochs=3", "--trainer.limit_train_batches=8",
         "--model=tests.helpers.sharded_probe.NonFiniteFrom", "--model.nan_from_step=10",
         "--model.width=8"],
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    (line,) = [x for x in _said(result) if x.startswith("error:")]
    assert "NaN or Inf at step 10" in line, line
    saved = checkpoint_file.read_checkpoint(
        tmp_path / "runs" / "fsdp" / "version_0" / "checkpoints" / "last.ckpt"
    )
    assert saved["global_step"] == 8  # the end of epoch 0: nothing after the NaN


@pytest.mark.slow
def test_code_we_did_not_write_shards_or_is_told_why_in_one_line(tmp_path):
    """A dict-batch module in users' style (Adam, prog_bar=True) shards and reports as the
    example does; Lightning's BoringModel, which shards nothing, is one line before any
    rank starts (Lightning's own check would be a traceback on every rank)."""
    blobs = [
        "--model=tests.helpers.sharded_probe.ShardedBlobClassifier",
        "--data=tests.helpers.foreign_modules.BlobData",
        "--trainer.callbacks+=tests.helpers.sharded_probe.RecordParameters",
    ]
    result = run_entry_point([*SHARDED_DDP, "--trainer.max_epochs=1", *blobs], cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert output.count("fit done in") == 1 and "over 2 process(es)" in output
    held = [json.loads((tmp_path / "shards" / f"params_rank{r}.json").read_text()) for r in (0, 1)]
    assert all(h["all_dtensors"] and h["mesh_sizes"] == [2] for h in held), held
    # the module's own per-step read (torchmetrics' bincount in its accuracy) is named at
    # its line; its prog_bar=True values cost nothing under the template's bar
    syncs = json.loads((tmp_path / "runs" / "fsdp" / "version_0" / "syncs.json").read_text())
    steady = [s for s in syncs["sites"] if s["steady_count"]]
    assert any(s["filename"].endswith("foreign_modules.py") and s["op"].startswith("bincount")
               for s in steady), steady  # fmt: skip
    assert not [s for s in steady if s["op"] == "Tensor.item()"], steady

    boring = run_entry_point(
        [*SHARDED_DDP, "--model=lightning.pytorch.demos.boring_classes.BoringModel",
         "--data=lightning.pytorch.demos.boring_classes.BoringDataModule"],
        cwd=tmp_path,
    )  # fmt: skip
    assert boring.returncode == 2, boring.stderr[-2000:]
    assert _said(boring) == [
        "error: STRATEGY=fsdp: BoringModel shards nothing; give it a configure_model() that "
        "calls torch.distributed.fsdp.fully_shard on its repeated blocks, then on itself, over "
        "self.device_mesh['data_parallel'] (as template/models/classifier.py does), or train "
        "it with DDP"
    ]
    assert "Traceback" not in boring.stderr and "distributed processes" not in boring.stderr
