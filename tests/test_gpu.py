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


# -- StreamPrefetcher on CUDA ----------------------------------------------------------

SANITIZED_PREFETCH = r"""
import torch
from template.perf.prefetch import PrefetchIterator, PrefetchStats, StreamCopier

torch.manual_seed(0)
batches = [torch.randn(256, 1024).pin_memory() for _ in range(12)]
pageable = [torch.randn(64, 1024) for _ in range(4)]
w = torch.randn(1024, 1024, device="cuda")
copier = StreamCopier("cuda")
for epoch in range(2):  # the same side stream across passes
    stats = PrefetchStats()
    total = torch.zeros((), device="cuda")
    for i, x in enumerate(PrefetchIterator(batches + pageable, copier, depth=2, stats=stats)):
        y = x @ w                    # reads the batch on the compute stream
        x.mul_(0.5)                  # writes it too: must be ordered after the copy
        total += y.sum() + x.sum()
    expected = sum(((b.cuda() @ w).sum() + (b.cuda() * 0.5).sum()) for b in batches + pageable)
    torch.testing.assert_close(total, expected, rtol=1e-4, atol=1e-2)
copier.poll(block=True)
assert stats.copies == 16 and stats.exposed_copies == 16, stats
print("sanitized run ok")
"""


def test_prefetch_is_race_free_under_the_cuda_stream_sanitizer(tmp_path):
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", SANITIZED_PREFETCH],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "data race" not in output.lower(), output[-4000:]
    assert "sanitized run ok" in output


def test_lightning_fit_under_the_sanitizer_with_the_prefetcher(tmp_path):
    import os

    from tests.conftest import run_entry_point

    result = run_entry_point(
        ["fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.precision=32-true"],
        cwd=tmp_path, env={"TORCH_CUDA_SANITIZER": "1"}, timeout=600,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "data race" not in output.lower(), output[-4000:]
    assert "prefetch: " in output and os.path.isdir(tmp_path / "runs")


def test_copies_of_the_next_batch_overlap_the_current_steps_kernels(tmp_path):
    """From a profiler trace: each prefetched host-to-device copy runs while kernels run."""
    import json

    from torch.profiler import ProfilerActivity, profile

    from template.perf.prefetch import PrefetchIterator, StreamCopier

    batches = [torch.randn(8192, 4096).pin_memory() for _ in range(8)]  # 128 MiB each
    w = torch.randn(4096, 4096, device="cuda")
    copier = StreamCopier("cuda")
    for x in PrefetchIterator(batches[:2], copier):  # warm-up: stream, allocator, cuBLAS
        (x @ w).sum()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for x in PrefetchIterator(batches, copier):
            y = x
            for _ in range(6):  # compute comparable to the copy
                y = torch.tanh(y @ w)
        torch.cuda.synchronize()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert len(copies) >= len(batches) and kernels

    def overlap(a, b):
        return min(a["ts"] + a["dur"], b["ts"] + b["dur"]) - max(a["ts"], b["ts"])

    copy_streams = {c["args"].get("stream") for c in copies}
    kernel_streams = {k["args"].get("stream") for k in kernels}
    assert copy_streams.isdisjoint(kernel_streams), "copies ran on the compute stream"
    # Every copy after the first (which nothing precedes) overlaps some kernel, by at
    # least half its duration.
    later = sorted(copies, key=lambda e: e["ts"])[1:]
    hidden = [max((overlap(c, k) for k in kernels), default=0) >= 0.5 * c["dur"] for c in later]
    assert sum(hidden) >= len(later) - 1, f"{sum(hidden)} of {len(later)} copies overlapped"


def test_callback_on_cuda_delivers_the_same_batches_and_measures_exposure(tmp_path):
    import lightning.pytorch as pl

    from template.callbacks import StreamPrefetcher
    from tests.test_stream_prefetcher import Numbers, Reads, Recorder

    def fit(callbacks, pin):
        Reads.count = 0

        class Model(Recorder):
            def train_dataloader(self):
                return torch.utils.data.DataLoader(self.train_set, batch_size=4, pin_memory=pin)

        model = Model(train=Numbers(40), val=Numbers(8, offset=100))
        pl.Trainer(
            accelerator="gpu",
            devices=1,
            max_epochs=2,
            val_check_interval=0.5,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
            callbacks=callbacks,
        ).fit(model)
        return model.seen, Reads.count

    plain = fit([], pin=True)
    prefetch = StreamPrefetcher()
    assert fit([prefetch], pin=True) == plain
    summary = prefetch.summary()
    assert summary["exposed_copy_ms"] is not None and summary["hidden_copy_pct"] is not None
    assert summary["pageable_batches"] == 0

    # Pageable batches: the same results, a warning once, and they are counted.
    unpinned = StreamPrefetcher()
    with pytest.warns(UserWarning, match="pin_memory=True") as record:
        assert fit([unpinned], pin=False) == plain
    assert sum("pin_memory=True" in str(w.message) for w in record) == 1
    assert unpinned.summary()["pageable_batches"] > 0
