"""Checkpoints are safe to write: an interrupted write leaves the previous file whole."""

from __future__ import annotations

import fsspec.implementations.local as local_fs
import lightning.pytorch as pl
import pytest
import torch

from tests.conftest import DEBUG, DEFAULT


def test_an_interrupted_checkpoint_write_leaves_the_previous_checkpoint_whole(
    tmp_path, monkeypatch
):
    """Lightning writes through an fsspec transaction (a temporary file, moved into place
    on success). This pins that behaviour: if a release wrote in place, a crash or a full
    disk mid-write would leave a truncated last.ckpt where the good one was."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    model = BoringModel()
    trainer = pl.Trainer(max_steps=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
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
    from template.train import main

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
