"""A NaN or Inf loss stops the run at the next check, names the step, and keeps the last
good checkpoint; the watch itself reads nothing back per step."""

from __future__ import annotations

import math

import torch

from gpu_busy.faults.nonfinite import FirstNonFinite
from gpu_busy.syncs import assert_no_syncs
from template.models import ImageClassifier
from tests.conftest import DEBUG, DEFAULT, cli_main


def test_first_non_finite_update_is_recorded_on_the_device_without_syncs():
    for fold_every in (64, 2, 1):  # checked at the read, across batches of checks, each time
        watch = FirstNonFinite(fold_every=fold_every)
        values = [1.0, 2.0, 4.0, math.nan, 3.0, math.inf]
        for v in values:
            assert_no_syncs(watch.update, torch.tensor(v), device_type="cpu")
        assert_no_syncs(watch.first_tensor, device_type="cpu")
        assert watch.first() == 3, fold_every
        watch.update(torch.tensor(math.nan))
        assert watch.first() == 3  # the first stays the first
    clean = FirstNonFinite()
    clean.update(torch.tensor(1.0))
    assert clean.first() is None and FirstNonFinite().first() is None


def test_a_nan_loss_stops_the_run_naming_the_step_and_keeps_the_last_good_checkpoint(
    tmp_path, monkeypatch, capsys
):
    main = cli_main()

    step_with_nan = 15  # epoch 1 (12 steps per epoch), a logging step with every 4
    original = ImageClassifier.training_step

    def training_step(self, batch, batch_idx):
        loss = original(self, batch, batch_idx)
        return loss * math.nan if self.trainer.global_step >= step_with_nan else loss

    monkeypatch.setattr(ImageClassifier, "training_step", training_step)
    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "fit", "--config", DEFAULT, "--config", DEBUG,
            "--trainer.limit_train_batches=12", "--trainer.max_epochs=3",
            "--trainer.log_every_n_steps=4",
        ]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"NaN or Inf at step {step_with_nan}" in lines[0], err[-2000:]
    assert "Traceback" not in err
    checkpoints = tmp_path / "runs" / "debug" / "version_0" / "checkpoints"
    assert "runs/debug/version_0/checkpoints/last.ckpt" in lines[0]
    saved = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 12  # the end of epoch 0: nothing after the NaN
    weights = [t for t in saved["state_dict"].values() if t.is_floating_point()]
    assert all(torch.isfinite(t).all() for t in weights)


def test_a_save_between_checks_is_refused_after_a_nan(tmp_path, monkeypatch, capsys):
    """A save outside the regular checks (StopOnSignal's, a user's mid-epoch one) is checked
    in on_save_checkpoint: nothing is written from non-finite weights."""
    main = cli_main()

    original = ImageClassifier.training_step

    def training_step(self, batch, batch_idx):
        loss = original(self, batch, batch_idx)
        return loss * math.nan if self.trainer.global_step >= 1 else loss

    monkeypatch.setattr(ImageClassifier, "training_step", training_step)
    monkeypatch.chdir(tmp_path)
    mid = tmp_path / "mid.ckpt"
    code = main(
        [
            "fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.log_every_n_steps=50",
            "--trainer.callbacks+=tests.helpers.faults_probe.SaveAndStop",
            "--trainer.callbacks.init_args.step=3", f"--trainer.callbacks.init_args.path={mid}",
        ]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "NaN or Inf at step 1" in line, err[-2000:]
    assert not mid.exists()
