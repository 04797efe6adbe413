"""Exact resume: stopping and resuming changes nothing, to the last bit (CPU, one process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import DEBUG, DEFAULT, cli_main

main = cli_main()  # skips this module where the entry point cannot be imported

# Two epochs of 4 batches; the LR schedule spans both, so every run keeps max_epochs=2.
RUN = ["fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.max_epochs=2",
       "--data.num_workers=1"]  # fmt: skip


STOP = "--trainer.callbacks+=tests.helpers.faults_probe.SaveAndStop"


def fit(tmp_path: Path, name: str, *extra: str) -> None:
    record = f"--trainer.callbacks.init_args.path={tmp_path / (name + '.batches')}"
    probe = "--trainer.callbacks+=tests.helpers.faults_probe.RecordBatches"
    args = [*RUN, f"--trainer.logger.init_args.name={name}", probe, record, *extra]
    assert main(args) == 0


def assert_same_training_state(a: Path, b: Path) -> None:
    first = torch.load(a, map_location="cpu", weights_only=True)
    second = torch.load(b, map_location="cpu", weights_only=True)
    assert (first["epoch"], first["global_step"]) == (second["epoch"], second["global_step"])
    for key, value in first["state_dict"].items():
        assert torch.equal(value, second["state_dict"][key]), f"weights differ: {key}"
    for one, two in zip(first["optimizer_states"], second["optimizer_states"], strict=True):
        for index, state in one["state"].items():
            for name, value in state.items():
                assert torch.equal(value, two["state"][index][name]), f"optimizer {index}.{name}"
    assert first["lr_schedulers"] == second["lr_schedulers"]
    assert (
        first["loops"]["fit_loop"]["epoch_progress"]
        == second["loops"]["fit_loop"]["epoch_progress"]
    )


def steps(path: Path) -> list[str]:
    return path.read_text().splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["epoch_end", "mid_epoch"])
def test_stopping_and_resuming_ends_where_an_uninterrupted_run_ends(in_tmp, where):
    fit(in_tmp, "whole")
    whole = in_tmp / "runs" / "whole" / "version_0" / "checkpoints" / "last.ckpt"

    if where == "epoch_end":
        # Stop after epoch 0 (its last.ckpt), then --ckpt_path last runs epoch 1.
        fit(in_tmp, "split", STOP, "--trainer.callbacks.init_args.step=4",
            "--trainer.callbacks.init_args.at_epoch_end=true")  # fmt: skip
        fit(in_tmp, "split", "--ckpt_path=last")
    else:
        # Stop mid-way through epoch 1 (after step 6 of 8) and resume from that checkpoint.
        mid = in_tmp / "mid.ckpt"
        fit(in_tmp, "split", STOP, "--trainer.callbacks.init_args.step=6",
            f"--trainer.callbacks.init_args.path={mid}")  # fmt: skip
        fit(in_tmp, "split", f"--ckpt_path={mid}")
    resumed = in_tmp / "runs" / "split" / "version_1" / "checkpoints" / "last.ckpt"

    # The same batches, with the same random crops and flips, at the same steps ...
    assert steps(in_tmp / "split.batches") == steps(in_tmp / "whole.batches")
    # ... and the same weights, optimizer moments, schedule and counters at the end.
    assert_same_training_state(whole, resumed)
