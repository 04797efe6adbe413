"""A read on the CPU side of a branch on the device is no GPU sync (syncs.device_branches):
listed as CPU only, left out of the count and of strict; a test whose truth on a GPU the
simulation cannot know keeps the sync counted and says so at the site."""

from __future__ import annotations

import pytest
import torch

from gpu_busy.syncs import assert_no_syncs, detect_syncs
from gpu_busy.syncs.sites import SyncSiteTable


def early_return_on_the_cpu(x):
    if x.device == torch.device("cpu"):
        return bool(x.sum() > 0)  # read: the CPU side
    return torch.where(x.sum() > 0, 1, 0)


def early_return_on_cuda(x):
    if x.is_cuda:
        return torch.where(x.sum() > 0, 1, 0)
    return x.sum().item()  # read: after the GPU side returned


def else_branch(x):
    if x.device.type == "cuda" or not x.is_cpu:
        y = x.sum()
    else:
        total = x.sum()
        y = total.item()  # read: the else side
    return y


def any_device(x):
    if x.device.type != "mps":  # CPU and CUDA alike
        return x.sum().item()
    return x


def and_a_flag(x, flag=True):
    if x.device.type == "cpu" and flag:  # False on a GPU, whatever the flag
        return x.sum().item()
    return x


def or_a_flag(x, flag=True):
    if x.device.type == "cpu" or flag:  # on a GPU: the flag's
        return x.sum().item()
    return x


def a_host_tensors_device(x, lengths):
    if lengths.device.type == "cpu":  # a host tensor stays there on a GPU too
        return x.sum().item()
    return x


def _detect(fn, *args):
    with detect_syncs(device_type="cpu") as rec:
        fn(*args)
    return rec


@pytest.mark.parametrize("fn", [early_return_on_the_cpu, early_return_on_cuda, else_branch])
def test_a_read_only_the_cpu_side_makes_is_cpu_only(fn):
    rec = _detect(fn, torch.ones(3))
    assert rec.events == []
    (read,) = rec.cpu_only
    assert read.function == fn.__name__ and read.cpu_only
    test_line = fn.__code__.co_firstlineno + 1
    assert read.branch.startswith(
        f"CPU only: this line does not run on a GPU (tests/syncs/test_device_branches.py:"
        f"{test_line} tests the device); the GPU side, tests/syncs/test_device_branches.py:"
    ), read.branch
    assert read.branch.endswith("did not run here: check it on a GPU")
    with detect_syncs(device_type="cpu", strict=True):
        fn(torch.ones(3))  # strict agrees: nothing raised
    assert_no_syncs(fn, torch.ones(3))


@pytest.mark.parametrize("fn", [any_device, and_a_flag, or_a_flag])
def test_a_read_that_runs_on_a_gpu_too_or_may_stays_counted(fn):
    rec = _detect(fn, torch.ones(3))
    if fn is and_a_flag:
        assert rec.events == [] and len(rec.cpu_only) == 1
        return
    (read,) = rec.events
    assert rec.cpu_only == [] and not read.cpu_only
    if fn is any_device:
        assert read.branch == ""
    else:
        assert read.branch.startswith("on a GPU this line may not run (")
        assert read.branch.endswith("the simulation cannot tell; check it on a GPU")
        assert "the simulation cannot tell" in str(read)


def test_a_branch_on_a_host_tensors_device_is_taken_on_a_gpu_too():
    x = torch.ones(3)
    with detect_syncs(device_type="cpu") as rec:
        lengths = torch.tensor([3])  # made without device=: host memory on a GPU
        a_host_tensors_device(x, lengths)
    assert len(rec.events) == 1 and rec.cpu_only == [] and rec.events[0].branch == ""


def test_the_report_lists_cpu_only_reads_apart_and_counts_none():
    rec = _detect(early_return_on_cuda, torch.ones(3))
    table = SyncSiteTable()
    table.add_all(rec.events + rec.cpu_only, step=3, logging=False)
    assert table.ranked() == [] and len(table.cpu_only()) == 1
    lines = table.render()
    assert lines[0] == "  seen only because this run is on the CPU (not counted above):"
    assert "Tensor.item()" in lines[1] and lines[2].strip().startswith("CPU only:")
