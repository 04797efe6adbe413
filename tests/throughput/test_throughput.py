"""Throughput, FLOPs, MFU and memory: the peak table, the counter against hand counts, the
device-clock spans on a scripted GPU, the allocator's peaks on a scripted allocator, and
the callback in real fits (beside Lightning's ThroughputMonitor, and under strict)."""

from __future__ import annotations

import json
import logging
import types

import pytest
import torch
from lightning.pytorch.callbacks import ThroughputMonitor as LightningThroughputMonitor
from lightning.pytorch.demos.boring_classes import BoringModel, ManualOptimBoringModel
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bench.throughput import hand_count
from gpu_busy.callbacks import RunSummary, SyncPointDetector, ThroughputMonitor
from gpu_busy.cuda_runtime import CudaRuntime, replaced_by
from gpu_busy.idle import StepTimer
from gpu_busy.report.compare import gates
from gpu_busy.report.files import RunFiles, write_report
from gpu_busy.report.throughput import Flops, end_of_fit
from gpu_busy.throughput import (
    TABLE,
    FlopCount,
    FlopCounts,
    MemoryPeaks,
    MemoryStats,
    ThroughputStats,
    WhatTrains,
    peak_flops,
)
from template.models.resnet import cifar_resnet
from tests.helpers.foreign_modules import CheckpointedBlocks, SyntheticTransformer
from tests.helpers.scripted_gpu import ScriptedGPU
from tests.helpers.trainers import quiet_trainer

# -- the peak table ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "precision", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),  # the SXM5 board, as torch names it
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "tf32", 417.5),
        ("NVIDIA H200", "bf16", 989.5),
        ("NVIDIA H200 NVL", "fp16", 835.5),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156),
        ("NVIDIA A100 80GB PCIe", "bf16", 312),
        ("NVIDIA L4", "bf16", 121),
        ("NVIDIA L40S", "bf16", 362.05),
        ("NVIDIA GeForce RTX 4090", "fp32", 82.6),
    ],
)
def test_a_known_device_reads_its_dense_datasheet_peak(name, precision, tflops):
    peak = peak_flops(name, precision)
    assert peak.flops == pytest.approx(tflops * 1e12)
    assert "datasheet" in peak.source or "whitepaper" in peak.source


@pytest.mark.parametrize(
    ("name", "precision", "why"),
    [
        ("cpu", "fp32", "no peak FLOP/s is known for cpu"),
        ("NVIDIA B200", "bf16", "no peak FLOP/s is known for NVIDIA B200"),
        ("NVIDIA A10G", "bf16", "publish no peak rates for the A10G"),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "bf16", "MIG slice"),
        ("NVIDIA H100 80GB HBM3", None, "has no None figure"),
    ],
)
def test_an_unknown_peak_is_na_with_the_reason_and_what_to_do(name, precision, why):
    peak = peak_flops(name, precision)
    assert peak.flops is None
    assert why in peak.reason and "peak_tflops=" in peak.reason


def test_an_override_wins_and_a_bad_one_is_refused():
    assert peak_flops("cpu", None, override_tflops=2.5).flops == 2.5e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16", override_tflops=700).flops == 700e12
    with pytest.raises(ValueError, match="above 0"):
        peak_flops("cpu", None, override_tflops=0)
    with pytest.raises(ValueError, match="peak_tflops"):
        ThroughputMonitor(peak_tflops=-1)


def test_every_row_cites_its_source_and_holds_dense_tensor_figures():
    for row in TABLE:
        assert row.source, row.name
        if not row.tflops:
            continue  # a device nobody publishes figures for: n/a, said so
        assert "https://" in row.source, row.name
        assert row.tflops["bf16"] == row.tflops["fp16"], row.name
        # dense tensor rates: never below the CUDA cores' fp32 rate, within the 2x-16x of
        # the generations in the table (a sparse figure would double them)
        assert row.tflops["fp32"] <= row.tflops["tf32"] <= row.tflops["bf16"], row.name
        assert row.tflops["bf16"] <= 16 * row.tflops["fp32"], row.name


# -- FLOPs against hand counts ------------------------------------------------------------


def _counted(model: nn.Module, x: torch.Tensor, loss=lambda y: y.sum()) -> int:
    count = FlopCount()
    out = count.around(model)(x)
    count.around(loss(out).backward)()
    return count.flops


def test_the_counter_agrees_with_a_hand_count_of_the_example_resnet():
    net, x = cifar_resnet(num_classes=10, width=8), torch.randn(4, 3, 32, 32)
    hand = hand_count(net, x)
    assert _counted(net, x) == pytest.approx(hand, rel=0.05)


def test_the_counter_agrees_with_a_hand_count_of_a_small_transformer():
    d, heads, ff, tokens, batch = 64, 4, 256, 32, 2
    layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
    x = torch.randn(batch, tokens, d, requires_grad=True)
    per_sequence = (
        4 * 2 * tokens * d * d  # q, k, v and out projections
        + 2 * 2 * tokens * tokens * d  # scores and the weighted sum
        + 2 * 2 * tokens * d * ff  # the feed-forward block
    )
    hand = 3 * batch * per_sequence  # forward, and a backward twice it (x needs a gradient)
    assert _counted(layer, x) == pytest.approx(hand, rel=0.05)


def test_a_backward_inside_a_counted_step_is_counted_once():
    net, x = nn.Linear(16, 8), torch.randn(4, 16)
    count = FlopCount()

    def step():  # manual optimisation: the backward runs inside the step
        count.around(net(x).sum().backward)()

    count.around(step)()
    assert count.flops == 3 * 2 * 4 * 16 * 8 - 2 * 4 * 16 * 8  # no input gradient


# -- throughput from the fit's one step timer, on a scripted GPU ---------------------------


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    return ScriptedGPU(capacity=8)


def _steps(timer: StepTimer, gpu: ScriptedGPU, ends_ms: list[float], samples: int = 8) -> None:
    for end in ends_ms:  # back to back: each step starts where the last ended
        gpu.times = [end - 10.0, end]
        timer.start_step()
        timer.end_step()
        timer.count_last(samples)


def test_throughput_sums_whole_periods_read_lazily_from_the_step_timer(gpu):
    timer, stats = StepTimer(torch.device("cuda", 0), pool=gpu), ThroughputStats()
    _steps(timer, gpu, [10.0, 20.0, 30.0, 40.0])
    assert timer.poll() == []  # the device is not there yet: no wait, no figure
    gpu.now = 40.0
    for t in timer.poll():
        stats.add_step(t)
    # the first step has no step before it: three whole periods of 10 ms
    assert (stats.steps, stats.samples, stats.device_ms) == (3, 24, 30.0)
    assert stats.rates()["samples_per_s"] == pytest.approx(800)


def test_a_break_leaves_the_next_step_out(gpu):
    timer, stats = StepTimer(torch.device("cuda", 0), pool=gpu), ThroughputStats()
    _steps(timer, gpu, [10.0, 20.0])
    timer.break_gap()  # validation: its time is not a step's
    _steps(timer, gpu, [510.0, 520.0], samples=4)
    for t in timer.close():  # blocks: training is over
        stats.add_step(t)
    assert (stats.steps, stats.samples, stats.device_ms) == (2, 12, 20.0)
    assert gpu.in_use == 0


def test_a_dry_pool_says_what_went_untimed(gpu):
    gpu.capacity = 3
    timer, stats = StepTimer(torch.device("cuda", 0), pool=gpu), ThroughputStats()
    _steps(timer, gpu, [10.0, 20.0])  # the second step's end finds no event
    for t in timer.close():
        stats.add_step(t)
    assert stats.untimed_steps == 1 and stats.steps == 0 and gpu.in_use == 0


def test_steps_without_a_size_or_tokens_make_those_rates_na():
    stats = ThroughputStats(steps=4, device_ms=100.0, samples=0, unsized_steps=4)
    stats.untokened_steps = 4
    assert stats.rates() == {"samples_per_s": None, "tokens_per_s": None, "steps_per_s": 40.0}


# -- the allocator's peaks, scripted ---------------------------------------------------------


class ScriptedAllocator(CudaRuntime):
    """The allocator's peaks as the test scripts them, behind the machinery's CUDA door."""

    def __init__(self) -> None:
        self.resets, self.peaks = 0, []

    def reset_memory_peaks(self, device) -> None:
        self.resets += 1

    def memory_peaks(self, device) -> tuple[int, int]:
        return self.peaks.pop(0)


def test_memory_peaks_are_read_once_per_window_and_leave_validation_out():
    with replaced_by(ScriptedAllocator()) as alloc:
        memory = MemoryPeaks(torch.device("cuda", 0))
        alloc.peaks = [(2 * 2**30, 3 * 2**30), (4 * 2**30, 5 * 2**30), (1 * 2**30, 6 * 2**30)]
        memory.start()
        # steps: no call of the allocator until the window ends
        assert alloc.resets == 1 and len(alloc.peaks) == 3
        memory.pause()  # validation: the training peak so far joins the window
        memory.pause()  # asked twice, read once
        memory.start()
        assert memory.take_window().gib() == {"peak_allocated_gib": 4.0, "peak_reserved_gib": 5.0}
        assert alloc.resets == 3  # the fit's start, after validation, the next window
        assert memory.take_window().gib() == {"peak_allocated_gib": 1.0, "peak_reserved_gib": 6.0}
    assert memory.total.gib() == {"peak_allocated_gib": 4.0, "peak_reserved_gib": 6.0}
    assert memory.total.windows == 2 and memory.window.windows == 0


def test_memory_on_a_cpu_measures_nothing():
    class Fails(CudaRuntime):
        def memory_peaks(self, device):
            raise AssertionError("the allocator was asked on a CPU")

        reset_memory_peaks = memory_peaks

    with replaced_by(Fails()):
        memory = MemoryPeaks("cpu")
        memory.start()
        memory.pause()
        assert memory.take_window().gib()["peak_allocated_gib"] is None


def _report(allocated_gib: float, reserved_gib: float, mfu_peak: float | None = 100.0):
    stats = ThroughputStats(
        steps=10, device_ms=1000.0, samples=320, untokened_steps=10, flops=10 * 1e12
    )
    memory = MemoryStats(2, allocated_gib * 2**30, reserved_gib * 2**30)
    peak = peak_flops("cpu", None, override_tflops=mfu_peak)
    flops = Flops(1e12, 32, "counted")
    return end_of_fit(
        [stats], [memory], flops=flops, peak=peak, device="NVIDIA L4", precision="bf16",
        clock="cuda events", warmup_steps=5,
    )  # fmt: skip


def test_the_report_gives_throughput_mfu_and_memory(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    report, lines = _report(8.0, 9.0)
    assert report["samples_per_s"] == pytest.approx(320)  # 10 batches of 32 in 1 s
    assert report["achieved_tflops"] == pytest.approx(10)  # 10 steps of 1e12 in 1 s
    assert report["mfu"] == pytest.approx(0.1)
    assert lines[0] == "throughput: 320 samples/s; MFU 10.0% (10.00 of 100 TFLOP/s per device)"
    assert "8.00 GiB allocated, 9.00 GiB reserved" in lines[2]
    assert not any("fragmentation" in line for line in lines)
    _, lines = _report(4.0, 12.0)
    assert "8.00 GiB reserved above the peak" in lines[3]
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in lines[3]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert "expandable_segments is on already" in _report(4.0, 12.0)[1][3]


def test_a_run_with_no_timed_step_says_that_is_why_throughput_is_na():
    stats = ThroughputStats()  # every step was warm-up: none timed, none sized
    memory = MemoryStats(0, None, None)
    _, lines = end_of_fit(
        [stats], [memory], flops=Flops(None, None, "n/a"), peak=peak_flops("cpu", None),
        device="cpu", precision="32-true", clock="host clock", warmup_steps=5,
    )  # fmt: skip
    assert lines[0].startswith("throughput: n/a (no step timed after the 5 warm-up steps")
    assert "without a size" not in lines[0]


def test_mfu_without_a_peak_is_na_with_the_reason():
    stats = ThroughputStats(steps=10, device_ms=1000.0, samples=320, untokened_steps=10)
    report, lines = end_of_fit(
        [stats], [MemoryStats()], flops=Flops(1e9, 32, "counted"),
        peak=peak_flops("cpu", None), device="cpu", precision=None, clock="host clock",
        warmup_steps=5,
    )  # fmt: skip
    assert report["mfu"] is None
    assert lines[0].endswith("MFU n/a: no peak FLOP/s is known for cpu; give peak_tflops= for MFU")
    assert "peak memory n/a" in lines[2]


# -- compare gates on throughput and MFU ----------------------------------------------------


def test_compare_gates_on_steady_throughput_and_mfu(tmp_path):
    def run(name, samples_per_s, mfu):
        folder = tmp_path / name
        write_report(folder, "run", {"samples_per_s": 1.0})  # the fit's: not the steady one
        write_report(folder, "throughput", {"samples_per_s": samples_per_s, "mfu": mfu})
        return RunFiles(folder)

    a = run("a", 1000.0, 0.40)
    out = gates(a, run("b", 990.0, 0.30), threshold=0.05, sync_threshold=None)
    assert out[0].startswith("throughput gate passed: samples/s, steady -1.0%")
    assert out[1].startswith("MFU gate FAILED: 40.0% -> 30.0%")
    assert out[-1] == "worse: B failed the MFU gate"
    out = gates(a, run("c", 900.0, 0.40), threshold=0.05, sync_threshold=None)
    assert out[-1] == "worse: B failed the throughput gate"


# -- the callback in real fits ----------------------------------------------------------------


class Wide(BoringModel):
    """A step long enough (a few ms) for two host clocks to agree to 2%."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 2))

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64 * 40, 32)), batch_size=64)

    def training_step(self, batch, batch_idx):
        return super().training_step(batch[0], batch_idx)


def test_throughput_agrees_with_lightnings_monitor_on_the_same_fit(tmp_path):
    # The same interval on both: Lightning's window holds every batch end, ours opens at
    # the first batch's end (warmup_steps=1), so both time batches 1..39.
    ours = ThroughputMonitor(warmup_steps=1)
    theirs = LightningThroughputMonitor(batch_size_fn=lambda b: len(b[0]), window_size=40)
    trainer = quiet_trainer(
        max_epochs=1, callbacks=[ours, theirs], logger=CSVLogger(tmp_path), log_every_n_steps=40
    )
    trainer.fit(Wide())
    lightning = trainer.callback_metrics.get("train/device/samples_per_sec")
    if lightning is None:  # logged, not kept in callback_metrics: read the logger's file
        rows = (tmp_path / "lightning_logs/version_0/metrics.csv").read_text().splitlines()
        head = rows[0].split(",")
        col = head.index("train/device/samples_per_sec")
        lightning = float(next(r.split(",")[col] for r in rows[1:] if r.split(",")[col]))
    assert ours.report["timed_steps"] == 39
    assert ours.report["samples_per_s"] == pytest.approx(float(lightning), rel=0.02)
    # each logging window's rate, for make compare's noise: here one window, the whole fit
    assert ours.report["window_samples_per_s"] == [pytest.approx(ours.report["samples_per_s"])]


class Syncless(Wide):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss["loss"])  # Lightning's own logging: no read per step
        return loss


def test_the_monitor_adds_no_sync_under_strict_and_leads_the_summary(tmp_path, caplog):
    detector = SyncPointDetector(strict=True, first_steps=1000)
    monitor = ThroughputMonitor(warmup_steps=2)
    trainer = quiet_trainer(
        max_epochs=2,
        limit_train_batches=12,
        callbacks=[detector, monitor, RunSummary()],
        logger=CSVLogger(tmp_path),
        log_every_n_steps=4,
    )
    with caplog.at_level(logging.INFO, logger="gpu_busy"):
        trainer.fit(Syncless())
    assert detector.report["steady_syncs_per_batch"] == 0
    assert detector.report["watched_batches"] == 24
    report = json.loads((tmp_path / "lightning_logs/version_0/throughput.json").read_text())
    # 2 warm-up steps; each epoch's first step opens a span (its gap held the epoch's end)
    assert report["timed_steps"] == 10 + 11
    assert report["flops_per_batch"] == 3 * 2 * 64 * (32 * 1024 + 1024 * 2) - 2 * 64 * 32 * 1024
    assert report["mfu"] is None and "no peak FLOP/s is known for cpu" in report["peak_source"]
    messages = [r.getMessage() for r in caplog.records]
    first = next(i for i, m in enumerate(messages) if m.startswith("throughput: "))
    assert messages[first].startswith("throughput: ") and "samples/s" in messages[first]
    assert first < next(i for i, m in enumerate(messages) if m.startswith("fit done in"))
    metrics = (tmp_path / "lightning_logs/version_0/metrics.csv").read_text()
    assert "throughput/samples_per_s" in metrics
    run = json.loads((tmp_path / "lightning_logs/version_0/run.json").read_text())
    assert run["throughput"]["samples_per_s"] == report["samples_per_s"]
    assert run["throughput"]["flops_per_batch"] == report["flops_per_batch"]


def test_the_wrappers_leave_the_module_after_the_counted_step_even_when_it_fails():
    class Fails(Wide):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("the user's bug")

    model = Fails()
    with pytest.raises(RuntimeError, match="the user's bug"):
        quiet_trainer(max_steps=2, callbacks=[ThroughputMonitor()]).fit(model)
    assert "training_step" not in vars(model) and "backward" not in vars(model)
    model = Wide()
    quiet_trainer(max_steps=2, callbacks=[ThroughputMonitor()]).fit(model)
    assert "training_step" not in vars(model) and "backward" not in vars(model)


def test_manual_optimisation_counts_its_backward_once():
    monitor = ThroughputMonitor(warmup_steps=1)
    quiet_trainer(max_steps=4, callbacks=[monitor]).fit(ManualOptimBoringModel())
    # Linear(32, 2) on a batch of 1: forward, weight gradient (no input gradient)
    assert monitor.report["flops_per_batch"] == 2 * 2 * 32 * 2


def test_a_foreign_transformer_is_counted_and_given_flops_are_used():
    monitor = ThroughputMonitor(warmup_steps=1)
    quiet_trainer(max_steps=4, callbacks=[monitor]).fit(SyntheticTransformer())
    # its attention included: the CPU's fused kernel is counted (CPU_ATTENTION)
    model, (x, y) = SyntheticTransformer(), next(iter(SyntheticTransformer().train_dataloader()))
    count = FlopCount()
    count.around(lambda: model.training_step((x, y), 0).backward())()
    assert monitor.report["flops_per_batch"] == count.flops > 0
    assert "FlopCounterMode" in monitor.report["flops_counted"]

    given = ThroughputMonitor(warmup_steps=1, flops_per_batch=1e9, peak_tflops=1.0)
    quiet_trainer(max_steps=4, callbacks=[given]).fit(SyntheticTransformer())
    assert given.report["flops_counted"] == "given (flops_per_batch=)"
    assert given.report["mfu"] > 0
    assert given.report["mfu"] == pytest.approx(given.report["achieved_tflops"])  # of 1 TFLOP/s


def test_a_block_checkpointed_under_no_grad_trains_under_the_default_callbacks(tmp_path):
    """openai's checkpointing (a custom autograd Function running modules under no_grad)
    ended the fit's first step inside FlopCounterMode's module tracker; counted now."""
    from bench.host import default_config_parts

    callbacks, plugins = default_config_parts()
    trainer = quiet_trainer(
        max_steps=6, callbacks=callbacks, plugins=plugins, logger=CSVLogger(tmp_path),
        enable_checkpointing=True, enable_progress_bar=True, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(CheckpointedBlocks())
    assert trainer.global_step == 6
    monitor = next(c for c in callbacks if isinstance(c, ThroughputMonitor))
    model, (x,) = CheckpointedBlocks(), next(iter(CheckpointedBlocks().train_dataloader()))
    count = FlopCount()
    count.around(lambda: model.training_step((x,), 0).backward())()
    # the recomputed forward in backward counts: the hardware ran it
    assert monitor.report["flops_per_batch"] == count.flops > 0


def test_a_flop_formula_that_raises_loses_the_count_not_the_step(monkeypatch):
    from torch.utils import flop_counter

    def broken(*args, **kwargs):
        raise ValueError("no formula for these shapes")

    monkeypatch.setitem(flop_counter.flop_registry, torch.ops.aten.mm, broken)
    a, b = torch.randn(4, 8), torch.randn(8, 2)
    count = FlopCount()
    out = count.around(torch.mm)(a, b)
    assert torch.equal(out, a @ b) and count.calls == 1
    assert count.flops is None and "ValueError: no formula for these shapes" in count.error


def test_tokens_come_from_the_batch_when_it_says(tmp_path):
    class Counted(Wide):
        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(64 * 8, 32)), batch_size=64,
                              collate_fn=lambda rows: {"x": torch.stack([r[0] for r in rows]),
                                                       "num_tokens": 10 * len(rows)})  # fmt: skip

        def training_step(self, batch, batch_idx):
            return BoringModel.training_step(self, batch["x"], batch_idx)

    monitor = ThroughputMonitor(warmup_steps=1)
    quiet_trainer(max_steps=8, callbacks=[monitor]).fit(Counted())
    assert monitor.report["tokens_per_s"] == pytest.approx(10 * monitor.report["samples_per_s"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_monitor_reads_memory_and_mfu_without_a_sync(tmp_path):
    detector = SyncPointDetector(strict=True, first_steps=1000)
    monitor = ThroughputMonitor(warmup_steps=2)
    quiet_trainer(accelerator="gpu", max_steps=30, callbacks=[detector, monitor]).fit(Syncless())
    report = monitor.report
    assert report["clock"] == "cuda events" and report["timed_steps"] > 0
    assert (
        report["peak_allocated_gib"] > 0
        and report["peak_reserved_gib"] >= (report["peak_allocated_gib"])
    )
    assert detector.report["steady_syncs_per_batch"] == 0
    # the backward ran on the autograd engine's device thread and was counted all the same
    assert report["flops_per_batch"] == 3 * 2 * 64 * (32 * 1024 + 1024 * 2) - 2 * 64 * 32 * 1024


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_lightnings_monitor_syncs_every_batch_and_ours_never(tmp_path):
    def steady_syncs(monitor) -> dict:
        detector = SyncPointDetector(first_steps=1000)
        quiet_trainer(accelerator="gpu", max_steps=20, callbacks=[detector, monitor]).fit(
            Syncless()
        )
        return detector.report

    theirs = steady_syncs(LightningThroughputMonitor(batch_size_fn=lambda b: len(b[0])))
    ours = steady_syncs(ThroughputMonitor())
    assert theirs["steady_syncs_per_batch"] >= 1  # torch.cuda.synchronize() in its _update
    assert ours["steady_syncs_per_batch"] == 0


def test_the_step_clock_counts_a_batch_as_lightning_does():
    from lightning.pytorch.utilities.data import extract_batch_size

    from gpu_busy.callbacks.step_clock import _batch_size

    batches = [
        (torch.ones(4, 3), torch.zeros(4)),  # the fast path: tensors in a tuple or a list
        [torch.ones(5), torch.ones(2)],
        (torch.tensor(1.0), torch.ones(3)),  # a 0-dim first tensor counts 1
        {"x": torch.ones(6, 2), "y": torch.ones(6)},
        ([torch.ones(7)], torch.ones(2)),
        torch.ones(3, 1),
    ]
    for batch in batches:
        assert _batch_size(batch) == extract_batch_size(batch)
    assert _batch_size(("no", "tensors")) is None


# -- FLOPs that follow the model ---------------------------------------------------------


class UnfreezesAtStep3(Wide):
    """Its first layer frozen until step 3, as BaseFinetuning unfreezes a backbone."""

    def on_train_start(self):
        self.layer[0].requires_grad_(False)

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == 3:
            self.layer[0].requires_grad_(True)


def _counted_step(model, unfrozen: bool) -> int:
    model.layer[0].requires_grad_(unfrozen)
    (x,) = next(iter(model.train_dataloader()))
    x = x.to(model.device)
    count = FlopCount()
    count.around(lambda: model.training_step((x,), 0)["loss"].backward())()
    return count.flops


def test_a_module_that_unfreezes_half_its_layers_is_counted_again_at_the_next_window():
    monitor = ThroughputMonitor(warmup_steps=1)
    quiet_trainer(max_steps=12, log_every_n_steps=2, callbacks=[monitor]).fit(UnfreezesAtStep3())
    frozen, unfrozen = (_counted_step(UnfreezesAtStep3(), u) for u in (False, True))
    assert unfrozen > frozen  # the first layer's weight gradient
    # step 3 unfreezes; the window at step 3 (a logging step) sees it; step 4 is counted
    counts = monitor.report["flop_counts"]
    assert [(c["first"], c["last"], c["flops_per_batch"]) for c in counts] == [
        (0, 3, frozen), (4, 11, unfrozen),
    ]  # fmt: skip
    assert monitor.report["flop_counts"][1]["why"] == "parameters that require grad: 2 -> 4 of 4"
    assert monitor.report["flops_per_batch"] == unfrozen
    assert "counted again where what trains changed" in monitor.report["flops_counted"]
    assert (
        "at steps 4-11 (parameters that require grad: 2 -> 4 of 4)"
        in monitor.report["flops_counted"]
    )


def test_the_timed_steps_flops_come_from_the_count_that_covers_each():
    counts = FlopCounts(limit=2)
    model, batch = Wide(), torch.randn(64, 32)
    state = WhatTrains.of(model, (batch,))
    counts.counted(0, 1000.0, 64, state, "the fit's first step")
    assert counts.check(WhatTrains.of(model, (batch[:10],)), next_step=5) is None  # short batch
    assert counts.of_step(7, samples=32) == 500.0  # per sample
    model.layer[0].requires_grad_(False)
    frozen = WhatTrains.of(model, (batch,))
    assert counts.check(frozen, next_step=10) == "parameters that require grad: 4 -> 2 of 4"
    counts.counted(10, 600.0, 64, frozen, "parameters that require grad: 4 -> 2 of 4")
    model.layer[0].requires_grad_(True)
    assert counts.check(state, next_step=20) is None  # met before: its count is reused
    assert counts.of_step(15, samples=64) == 600.0 and counts.of_step(25, samples=64) == 1000.0
    model.eval()
    assert counts.check(WhatTrains.of(model, (batch,)), next_step=30) is None  # the limit
    assert counts.of_step(35, samples=64) is None  # unknown, not the last count's
    assert [c["why"] for c in counts.covered(last_step=40)][2:] == [
        "parameters that require grad: 2 -> 4 of 4, as counted at step 0",
        "modules in training mode: 5 -> 0 of 5; not counted: 2 counts made already",
    ]
    stats = ThroughputStats()
    stats.add_step(types.SimpleNamespace(period_ms=1000.0, samples=64, tokens=None), 1000.0)
    assert stats.flops_per_s() == 1000.0
    stats.add_step(types.SimpleNamespace(period_ms=1000.0, samples=64, tokens=None), None)
    assert stats.flops_per_s() is None  # a step of unknown FLOPs: no FLOP/s for the window


class TaskSets(Wide):
    """A meta-learning batch: a list of two task sets, (x, y) of 32 samples each."""

    def train_dataloader(self):
        data = TensorDataset(torch.randn(8, 32, 32), torch.randint(0, 2, (8, 32)))
        return DataLoader(data, batch_size=2, collate_fn=list)  # [(x, y), (x, y)]

    def training_step(self, batch, batch_idx):
        x = torch.cat([task[0] for task in batch])
        return BoringModel.training_step(self, x, batch_idx)


class CountsItsSamples(TaskSets):
    def samples_in_batch(self, batch):
        return sum(len(task[0]) for task in batch)


def test_samples_per_batch_say_how_they_were_counted_and_a_module_may_count_its_own():
    guessed = ThroughputMonitor(warmup_steps=1)
    quiet_trainer(max_steps=6, callbacks=[guessed]).fit(TaskSets())
    assert guessed.report["samples_counted"] == (
        "the first dimension of the batch's first tensor, as Lightning's self.log"
    )
    assert guessed.report["samples_note"] == (
        "samples per batch counted as 32, the first tensor's first dimension; the batch holds "
        "batches (first dimensions 32): give the LightningModule a samples_in_batch(batch) "
        "method that returns its count"
    )
    own = ThroughputMonitor(warmup_steps=1)
    quiet_trainer(max_steps=6, callbacks=[own]).fit(CountsItsSamples())
    assert own.report["samples_counted"] == "the module's samples_in_batch(batch)"
    assert own.report["samples_note"] is None
    seconds = own.report["timed_steps"] / own.report["steps_per_s"]
    assert own.report["samples_per_s"] * seconds == pytest.approx(64 * own.report["timed_steps"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_recount_after_unfreezing_is_the_counters_own_count_of_an_unfrozen_step():
    monitor = ThroughputMonitor(warmup_steps=1)
    quiet_trainer(accelerator="gpu", max_steps=12, log_every_n_steps=2, callbacks=[monitor]).fit(
        UnfreezesAtStep3()
    )
    unfrozen = _counted_step(UnfreezesAtStep3().cuda(), True)
    assert [c["first"] for c in monitor.report["flop_counts"]] == [0, 4]
    assert monitor.report["flop_counts"][1]["flops_per_batch"] == unfrozen
