"""The program runs as it would without us: a hook receives the arguments it receives in a
plain fit, whatever signature it has, with every mechanism of the default set that wraps
or patches a user's method active (the FLOP count, taken again at each logging step where
what trains changed; the sync watch; the prefetcher).

Lightning reads a hook's signature to choose its arguments (one ``__wrapped__`` level, then
``inspect.getfullargspec``: ``utilities/signature_utils.py``); a wrapper that shows
``(*args, **kwargs)`` there makes it pass ``batch_idx`` to a ``training_step(self, batch)``.
"""

from __future__ import annotations

import functools
import inspect

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ProgressBar
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpu_busy.patches import signature_kept
from tests.helpers.trainers import default_callbacks, quiet_trainer


def _passing_through(fn):
    """A user's own decorator: Lightning reads what it wraps."""

    @functools.wraps(fn)
    def decorated(*args, **kwargs):
        return fn(*args, **kwargs)

    return decorated


class _Steps(pl.LightningModule):
    """Two layers; ``flip`` makes the second trainable on every other step (what the FLOP
    count hangs on changes at every logging step); ``manual``: manual optimisation with
    ``toggle_optimizer``, as Lightning's GAN example does."""

    def __init__(self, manual: bool) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 1)
        self.received: list[tuple] = []

    def on_train_batch_start(self, batch, batch_idx):
        self.second.requires_grad_(batch_idx % 2 == 0)

    def step(self, received: tuple, batch):
        self.received.append(tuple(type(a).__name__ for a in received))
        loss = self.second(torch.relu(self.first(batch[0]))).pow(2).mean()
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        self.toggle_optimizer(optimizer)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.untoggle_optimizer(optimizer)
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(48, 8)), batch_size=8)


class BatchOnly(_Steps):
    def training_step(self, batch):
        return self.step((batch,), batch)


class WithIndex(_Steps):
    def training_step(self, batch, batch_idx):
        return self.step((batch, batch_idx), batch)


class WithLoaderIndex(_Steps):
    def training_step(self, batch, batch_idx, dataloader_idx=0):
        return self.step((batch, batch_idx, dataloader_idx), batch)


class VarArgs(_Steps):
    def training_step(self, *args):
        return self.step(args, args[0])


class KeywordOnly(_Steps):
    def training_step(self, batch, *, scale=1.0):
        return self.step((batch, scale), batch)


class Decorated(_Steps):
    @_passing_through
    def training_step(self, batch):
        return self.step((batch,), batch)


SIGNATURES = [BatchOnly, WithIndex, WithLoaderIndex, VarArgs, KeywordOnly, Decorated]


def _fit(kind: type[_Steps], manual: bool, callbacks: list, tmp_path) -> list[tuple]:
    torch.manual_seed(0)
    model = kind(manual)
    trainer = quiet_trainer(
        max_steps=6, log_every_n_steps=1, callbacks=callbacks, default_root_dir=tmp_path
    )
    trainer.fit(model)
    return model.received


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
@pytest.mark.parametrize("kind", SIGNATURES, ids=lambda k: k.__name__)
def test_each_hook_signature_receives_what_a_plain_fit_passes(kind, manual, tmp_path):
    plain = _fit(kind, manual, [], tmp_path / "plain")
    measured_set = [c for c in default_callbacks() if not isinstance(c, ProgressBar)]
    measured = _fit(kind, manual, measured_set, tmp_path / "measured")
    assert len(plain) == 6
    assert measured == plain


@pytest.mark.parametrize("kind", SIGNATURES, ids=lambda k: k.__name__)
def test_a_kept_signature_reads_as_the_users_own(kind):
    """What Lightning reads (one unwrap, then getfullargspec) and what inspect.signature
    reads, of the user's bound method and of the wrapper put over it."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    own = kind(manual=False).training_step
    kept = signature_kept(own, lambda *args, **kwargs: own(*args, **kwargs))
    for param, min_args in (("batch_idx", 2), ("dataloader_idx", None)):
        assert is_param_in_hook_signature(kept, param, min_args=min_args) == (
            is_param_in_hook_signature(own, param, min_args=min_args)
        )
    assert inspect.signature(kept) == inspect.signature(own)
    assert kept.__self__ is own.__self__ and kept.__name__ == "training_step"


def test_a_kept_plain_function_reads_as_the_original():
    def original(loss, *args, retain=False):
        return loss

    kept = signature_kept(original, lambda *args, **kwargs: ("ours", original(*args, **kwargs)))
    assert inspect.signature(kept) == inspect.signature(original)
    assert inspect.getfullargspec(kept.__wrapped__) == inspect.getfullargspec(original)
    assert kept(3) == ("ours", 3)
