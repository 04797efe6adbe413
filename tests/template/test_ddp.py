"""A real 2-process DDP run of the entry point on the CPU (gloo), as a subprocess."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from template.data.synthetic import make_shapes
from tests.conftest import DEBUG, DEFAULT, run_entry_point


@pytest.mark.slow
def test_two_rank_cpu_ddp_trains_disjoint_shards_and_logs_once(tmp_path):
    size = 512  # 8 batches of 32 per rank
    result = run_entry_point(
        [
            "fit", "--config", DEFAULT, "--config", DEBUG,
            "--trainer.accelerator=cpu", "--trainer.devices=2",
            "--trainer.callbacks+=tests.helpers.ddp_probe.RecordShards",
            "--trainer.callbacks+=tests.helpers.ddp_probe.CountCollectives",
            f"--data.synthetic_train_size={size}", "--data.batch_size=32",
            "--data.augment=false", "--trainer.limit_train_batches=8",
            "--trainer.log_every_n_steps=4",
        ],
        cwd=tmp_path,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]

    shards = [(tmp_path / "shards" / f"rank{r}.txt").read_text().splitlines() for r in (0, 1)]
    # The run directory is the same on every rank.
    assert shards[0][0] == shards[1][0]
    rank0, rank1 = set(shards[0][1:]), set(shards[1][1:])
    assert len(rank0) == len(rank1) == size // 2
    assert not rank0 & rank1, "the ranks trained on overlapping images"
    images, _ = make_shapes(size, seed=0)
    everything = {hashlib.sha1(image.numpy().tobytes()).hexdigest() for image in images}
    assert rank0 | rank1 == everything

    # Third-party warnings (file.py:line: message) are shown by rank zero only: none twice.
    warned = [line for line in output.splitlines() if re.match(r"^\S+\.py:\d+: ", line)]
    assert len(warned) == len(set(warned)), warned
    assert len([w for w in warned if "every rank warns this" in w]) == 1, warned
    # Rank-zero lines appear once; per-rank lines once per rank, each naming its rank.
    assert output.count("run directory") == 1
    assert output.count("fit done in") == 1
    assert "over 2 process(es)" in output
    # StopOnSignal (every log_every_n_steps = 4 batches): after batches 4 and 8.
    assert output.count("[rank 0] trained on 256 images; stop checks [2]") == 1
    assert output.count("[rank 1] trained on 256 images; stop checks [2]") == 1
    # The prefetcher (in the default config) delivered each rank's batches (the shards
    # above are what the steps saw) and reported once, summed over both ranks.
    assert output.count("prefetch: 16 batches") == 1
    metrics = (tmp_path / "runs" / "debug" / "version_0" / "metrics.csv").read_text()
    assert "prefetch/copy_ms_rank_max" in metrics
    # The sync detector reported once, from both ranks' sites. In steady state (not a
    # logging step or the one after), no sync: Lightning's per-step SIGTERM broadcast
    # and .item() are gone; what is left is this test's probe.
    assert output.count("sync points:") == 1
    saved = json.loads((tmp_path / "runs" / "debug" / "version_0" / "syncs.json").read_text())
    assert saved["summary"]["watched_batches"] >= 1
    steady = [s for s in saved["sites"] if s["steady_count"] and "ddp_probe" not in s["filename"]]
    assert steady == [], steady
    assert not [s for s in saved["sites"] if "sigterm" in (s["via"] or "") and s["steady_count"]]
    # The idle monitor (default config) reduced both ranks' steps into one report.
    assert output.count("idle time:") == 1
    idle = json.loads((tmp_path / "runs" / "debug" / "version_0" / "idle.json").read_text())
    assert idle["world_size"] == 2 and len(idle["ranks"]) == 2
    assert [r["rank"] for r in idle["ranks"]] == [0, 1] and idle["mean"]["idle_pct"] is not None
    assert idle["rank_max"]["idle_pct"] == max(r["idle_pct"] for r in idle["ranks"])
    assert "idle/idle_pct_rank_max" in metrics and "idle/idle_other_ms_rank_max" in metrics
    # Collectives: gpu_busy's figures, sync counts and stop flag ride one gather per logging
    # step, StopOnNonFiniteLoss's device flag a second (read a window later, no wait), and
    # the first logging step one more, each window member's row length over ranks (a rank
    # whose member failed before it sends that many NaN); none in a steady step
    # (Lightning's per-step SIGTERM broadcast is gone too).
    for rank in (0, 1):
        seen = json.loads((tmp_path / "shards" / f"collectives_rank{rank}.json").read_text())
        steps, counts = seen["steps"], seen["counts"]
        assert steps == {"logging": 2, "steady": 6}, seen
        assert counts.get("steady ours", 0) == 0 and counts.get("steady others", 0) == 0, seen
        assert counts["logging ours"] == 2 * steps["logging"] + 1, seen
    # Files are written once, by rank zero: one version directory, one config.
    versions = sorted(p.name for p in (tmp_path / "runs" / "debug").iterdir())
    assert versions == ["version_0"]
    assert (tmp_path / "runs" / "debug" / "version_0" / "config.yaml").is_file()
    assert (tmp_path / "runs" / "debug" / "version_0" / "checkpoints" / "last.ckpt").is_file()
