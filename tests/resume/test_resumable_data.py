"""A DataModule of the user's own, made resumable by the public mixin alone
(``gpu_busy.resumable_data.ResumableData``): stopped mid-epoch and resumed, it trains the
batches an uninterrupted run trains, in the same order, on one process; a resume with
another batch size mid-epoch is refused with the flag to pass."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gpu_busy.errors import UserError
from gpu_busy.resumable_data import ResumableData
from tests.helpers.trainers import quiet_trainer


class OwnData(ResumableData, pl.LightningDataModule):
    """What a user writes: no private name, two lines for the resume."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.train_set = TensorDataset(torch.arange(20.0)[:, None])

    def train_dataloader(self) -> DataLoader:
        sampler = self.resumable_sampler(self.train_set, batch_size=self.batch_size)
        return DataLoader(self.train_set, self.batch_size, sampler=sampler, drop_last=True)


class Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[float]] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        self.seen.append(x.flatten().tolist())
        return (self.w * x).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class StopAfter(pl.Callback):
    def __init__(self, step: int, path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


def _fit(tmp_path, data, callbacks=(), ckpt_path=None) -> list[list[float]]:
    model = Recorder()
    pl.seed_everything(3)
    trainer = quiet_trainer(max_epochs=2, callbacks=list(callbacks), default_root_dir=tmp_path)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return model.seen


def test_a_users_datamodule_resumes_mid_epoch_where_it_stopped(tmp_path):
    whole = _fit(tmp_path, OwnData())
    assert len(whole) == 10  # two epochs of 5 batches
    mid = tmp_path / "mid.ckpt"
    first = _fit(tmp_path, OwnData(), [StopAfter(7, mid)])
    rest = _fit(tmp_path, OwnData(), ckpt_path=mid)
    assert first + rest == whole
    assert whole[:5] != whole[5:]  # each epoch has its own order


def test_a_mid_epoch_resume_with_another_batch_size_is_refused_with_the_flag(tmp_path):
    mid = tmp_path / "mid.ckpt"
    _fit(tmp_path, OwnData(), [StopAfter(2, mid)])
    with pytest.raises(UserError, match=r"--data\.batch_size=4"):
        _fit(tmp_path, OwnData(batch_size=2), ckpt_path=mid)
