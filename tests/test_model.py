from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import template.models.classifier as classifier
from template.errors import UserError
from template.models import ImageClassifier, cifar_resnet

# Ops that read a device value back to the host (the ones a dispatch mode can see).
HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "bincount"}


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_resnet18_layout_and_width():
    net = cifar_resnet(10)
    assert sum(p.numel() for p in net.parameters()) == pytest.approx(11.17e6, rel=0.01)
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    small = cifar_resnet(7, width=8, depth=34)
    assert small(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_training_step_reads_nothing_back_to_the_host(monkeypatch):
    model = ImageClassifier(num_classes=10, width=4)
    monkeypatch.setattr(classifier, "is_logging_step", lambda trainer: False)
    monkeypatch.setattr(ImageClassifier, "trainer", property(lambda self: None))
    batch = (torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))
    with RecordOps() as ops:
        loss = model.training_step(batch, 0)
        loss.backward()
    assert ops.names, "the dispatch mode saw nothing"
    assert not HOST_READS & set(ops.names), sorted(HOST_READS & set(ops.names))
    # The accumulated metrics are right once read.
    assert float(model.train_loss.compute()) == pytest.approx(float(loss), rel=1e-5)


def test_bad_hyperparameters_are_user_errors():
    with pytest.raises(UserError, match="num_classes"):
        ImageClassifier(num_classes=1)
    with pytest.raises(UserError, match="width must be positive"):
        ImageClassifier(width=0)
