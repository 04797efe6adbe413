"""Checkpoints are safe to write: an interrupted write leaves the previous file whole."""

from __future__ import annotations

import fsspec.implementations.local as local_fs
import pytest
import torch

from tests.conftest import DEBUG, DEFAULT, cli_main
from tests.helpers.trainers import quiet_trainer


def test_an_interrupted_checkpoint_write_leaves_the_previous_checkpoint_whole(
    tmp_path, monkeypatch
):
    """Lightning writes through an fsspec transaction (a temporary file, moved into place
    on success). This pins that behaviour: if a release wrote in place, a crash or a full
    disk mid-write would leave a truncated last.ckpt where the good one was."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    model = BoringModel()
    trainer = quiet_trainer(max_steps=2, default_root_dir=tmp_path)
    trainer.fit(model)
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    good = path.read_bytes()

    real_write = local_fs.LocalFileOpener.write

    def write_half_then_fail(self, data):
        real_write(self, bytes(data)[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(local_fs.LocalFileOpener, "write", write_half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        trainer.save_checkpoint(path)
    monkeypatch.undo()
    assert path.read_bytes() == good
    assert torch.load(path, map_location="cpu", weights_only=True)["global_step"] == 2


def test_an_unwritable_run_directory_is_one_line_before_training(tmp_path, monkeypatch, capsys):
    main = cli_main()

    monkeypatch.chdir(tmp_path)
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the run directory should go")
    code = main(
        ["fit", "--config", DEFAULT, "--config", DEBUG,
         f"--trainer.logger.init_args.save_dir={blocker / 'runs'}"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "cannot write the run directory" in lines[0], err[-1500:]
    assert "Traceback" not in err and "Epoch 0" not in err


def test_last_ckpt_is_the_latest_state_even_when_val_acc_does_not_improve(tmp_path, monkeypatch):
    """Lightning's save_last on a monitored ModelCheckpoint updates last.ckpt only in epochs
    that improve the monitored value; resuming from it would lose the later epochs."""
    from template.models import ImageClassifier

    main = cli_main()

    def worse_every_epoch(self):
        self.log("val/acc", 1.0 - 0.1 * self.current_epoch)
        self.val_loss.reset()
        self.val_acc.reset()

    monkeypatch.setattr(ImageClassifier, "on_validation_epoch_end", worse_every_epoch)
    monkeypatch.chdir(tmp_path)
    code = main(
        ["fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.max_epochs=3",
         "--trainer.limit_train_batches=4"]
    )  # fmt: skip
    assert code == 0
    checkpoints = tmp_path / "runs" / "debug" / "version_0" / "checkpoints"
    last = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=True)
    assert (last["epoch"], last["global_step"]) == (2, 12)
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "best-epoch00.ckpt",
        "last.ckpt",
    ]


class _RunsCode:
    """Unpickling this runs a command: what a malicious checkpoint would carry."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    main = cli_main()

    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "code-ran"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "extra": _RunsCode(marker)}, "evil.ckpt")
    torch.save([1, 2, 3], "truncated.ckpt")
    data = (tmp_path / "truncated.ckpt").read_bytes()
    (tmp_path / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    for name, expected in (
        ("evil.ckpt", "holds objects other than tensors and plain data (posix.system)"),
        ("truncated.ckpt", "is not a checkpoint"),
    ):
        assert main(["fit", "--config", DEFAULT, "--config", DEBUG, f"--ckpt_path={name}"]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and expected in lines[0], err[-1500:]
        assert "Traceback" not in err
    assert not marker.exists(), "the checkpoint's pickled code ran"


@pytest.mark.slow
def test_a_resume_into_a_fixed_version_keeps_the_earlier_metrics(tmp_path):
    """Schedulers fix the run's name (--trainer.logger.init_args.version=job42): the resumed
    run writes into the same directory, and its metrics.csv holds the whole run."""
    import csv

    from tests.conftest import DEBUG, DEFAULT, run_entry_point

    args = [
        "fit",
        "--config",
        DEFAULT,
        "--config",
        DEBUG,
        "--trainer.logger.init_args.version=job42",
    ]
    first = run_entry_point([*args, "--trainer.max_epochs=1"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    metrics = tmp_path / "runs" / "debug" / "job42" / "metrics.csv"
    with metrics.open() as f:
        before = {row["step"] for row in csv.DictReader(f) if row.get("train/loss")}
    second = run_entry_point([*args, "--trainer.max_epochs=2", "--ckpt_path=last"], cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "into the same version directory" in second.stderr
    with metrics.open() as f:
        after = {row["step"] for row in csv.DictReader(f) if row.get("train/loss")}
    assert before and before < after, (before, after)


@pytest.mark.slow
def test_a_slurm_requeue_save_lands_with_the_run_and_last_finds_it(tmp_path):
    from tests.conftest import DEBUG, DEFAULT, run_entry_point

    args = ["fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.max_epochs=2"]
    first = run_entry_point(
        [*args, "--trainer.callbacks+=tests.helpers.faults_probe.RequeueSaveAt",
         "--trainer.callbacks.init_args.step=2"],
        cwd=tmp_path,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    assert not list(tmp_path.glob("hpc_ckpt_*.ckpt")), "saved into the working directory"
    (requeued,) = (tmp_path / "runs" / "debug").glob("hpc_ckpt_*.ckpt")
    for last in (tmp_path / "runs").rglob("last*.ckpt"):
        last.unlink()  # the requeue save is the run's only one
    second = run_entry_point([*args, "--ckpt_path=last"], cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resuming from {requeued.relative_to(tmp_path)}" in second.stderr


def test_a_disk_that_turns_read_only_mid_run_ends_in_one_line_and_keeps_the_checkpoints(
    tmp_path, monkeypatch, capsys
):
    """A remount read-only refuses the staged file and then its clean-up too (EROFS from
    unlink, which missing_ok does not cover): one line, exit 1, earlier checkpoints whole."""
    import errno
    import pathlib

    from gpu_busy.resume import checkpoint_file

    main = cli_main()
    monkeypatch.chdir(tmp_path)
    real_write, real_unlink, writes = checkpoint_file._write_staged, pathlib.Path.unlink, []

    def read_only_after_two(path, stage, data):
        writes.append(path)
        if len(writes) > 2:  # the first epoch's best and last land
            raise OSError(errno.EROFS, "Read-only file system", str(stage))
        real_write(path, stage, data)

    def unlink(self, missing_ok=False):
        if len(writes) > 2:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(checkpoint_file, "_write_staged", read_only_after_two)
    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    code = main(["fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.max_epochs=3"])
    monkeypatch.undo()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert "Read-only file system" in lines[0] and "saved before it are intact" in lines[0]
    saved = {p.name: p for p in tmp_path.rglob("*.ckpt")}
    assert "last.ckpt" in saved
    assert torch.load(saved["last.ckpt"], weights_only=True)["epoch"] == 0


def test_checkpoint_callbacks_collide_where_one_folder_gets_one_name_twice(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from gpu_busy.callbacks.checkpoint_writers import colliding

    def made(**kwargs):
        return ModelCheckpoint(**{"dirpath": tmp_path, **kwargs})

    # Lightning's version counter (on by default) writes the second beside the first
    assert colliding([made(), made(monitor="loss")]) is None
    assert colliding([made(), made(monitor="loss", enable_version_counter=False)]) == (
        "ModelCheckpoint(filename=None) and ModelCheckpoint(filename=None) both write "
        f"{{epoch}}-{{step}}.ckpt in {tmp_path}: give one of them another dirpath or filename, "
        "or drop one"
    )
    assert colliding([made(), made(monitor="loss", dirpath=tmp_path / "other")]) is None
    assert colliding([made(filename="last", save_last=True)]) is None  # one writer
    assert colliding([made(filename="best"), made(save_top_k=0, save_last=True)]) is None
    off = {"enable_version_counter": False}
    assert "save_last=True" in colliding([made(filename="last", **off), made(save_last=True)])


def test_two_default_named_checkpoints_in_one_folder_both_write_with_the_set(tmp_path):
    """Lightning accepts them (the second's files get -v1): so does the set."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    import gpu_busy
    from tests.helpers.trainers import quiet_trainer

    folder = tmp_path / "checkpoints"
    pair = [ModelCheckpoint(dirpath=folder, monitor=m, mode="max") for m in ("epoch", "step")]
    quiet = {"enable_progress_bar": False, "enable_checkpointing": True}
    done = gpu_busy.complete(callbacks=pair, settings=quiet)
    trainer = quiet_trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=1,
                            logger=False, **quiet, **done.trainer_kwargs)  # fmt: skip
    trainer.fit(BoringModel())
    written = sorted(p.name for p in folder.iterdir())
    assert written == ["epoch=1-step=4-v1.ckpt", "epoch=1-step=4.ckpt"]


def test_on_tpus_the_set_leaves_the_checkpoint_io_to_xla_and_a_mock_checkpoint_is_passed_over():
    """Lightning's XLA strategy takes only its own XLACheckpointIO; a test's Mock of
    ModelCheckpoint has no folder (both found running Lightning's own tests)."""
    from unittest.mock import Mock

    from lightning.pytorch.callbacks import ModelCheckpoint

    import gpu_busy
    from gpu_busy.callbacks.checkpoint_writers import colliding

    done = gpu_busy.complete(settings={"accelerator": "tpu"})
    assert done.plugins == [] and "BackgroundCheckpointIO" in done.left_out
    assert gpu_busy.complete(settings={"accelerator": "cpu"}).plugins
    assert colliding([Mock(spec=ModelCheckpoint), ModelCheckpoint(dirpath=".")]) is None
