"""CUDA paths: run wherever CUDA is present (skipped without it)."""

from __future__ import annotations

import pytest
import torch

from template.data.augment import DeviceAugment
from template.train import main
from tests.conftest import DEBUG, DEFAULT

pytestmark = pytest.mark.gpu


def test_augment_on_cuda_matches_cpu_normalisation():
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8)
    augment = DeviceAugment()
    expected = augment(images, train=False)
    actual = augment.to("cuda")(images.cuda(), train=False)
    torch.testing.assert_close(actual.cpu(), expected)
    train = augment(images.cuda(), train=True)
    assert train.shape == images.shape and train.device.type == "cuda"


def test_default_gpu_run_resolves_bf16(in_tmp, capsys):
    # A short fit on one GPU; the summary line reports the resolved precision.
    assert main(["fit", "--config", DEFAULT, "--config", DEBUG]) == 0
    err = capsys.readouterr().err
    expected = "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    assert f"on cuda, precision {expected}" in err
