"""CUDA paths: run wherever CUDA is present (skipped without it)."""

from __future__ import annotations

import importlib
import time

import lightning.pytorch as pl
import pytest
import torch

from template.data.augment import DeviceAugment
from tests.conftest import CONFIGS, DEBUG, DEFAULT, cli_main
from tests.helpers.trainers import quiet_trainer

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


def test_a_sharded_fit_on_one_gpu_trains_and_reports(in_tmp, capsys):
    """configs/fsdp.yaml on one GPU: FSDP2 (one rank, NCCL), bf16-mixed, every callback."""
    fsdp = str(CONFIGS / "fsdp.yaml")
    assert main(["fit", "--config", DEFAULT, "--config", DEBUG, "--config", fsdp]) == 0
    err = capsys.readouterr().err
    assert "on cuda, precision" in err and "16-mixed" in err
    assert err.count("fit done in") == 1
    assert (in_tmp / "runs" / "fsdp" / "version_0" / "checkpoints" / "last.ckpt").is_dir()


# -- StreamPrefetcher on CUDA ----------------------------------------------------------

SANITIZED_PREFETCH = r"""
import torch
from gpu_busy.prefetch import PrefetchIterator, PrefetchStats, StreamCopier

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
    """What CSAN checks here: the side-stream copies issued from the main thread (the
    pinned batches) against the compute stream's reads and writes of them, i.e. the
    ``wait_event`` ordering. Not checked: the pageable batches' copies, issued from the
    pinning thread (CSAN's dispatch mode is thread-local: they are invisible to it, and
    only the values are compared), and the allocator's reuse of a handed-out batch's
    memory (CSAN does not model ``record_stream``; the test below that overwrites a
    batch checks it)."""
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

    from gpu_busy.prefetch import PrefetchIterator, StreamCopier

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

    from gpu_busy.idle.intervals import overlap_length

    copy_streams = {c["args"].get("stream") for c in copies}
    kernel_streams = {k["args"].get("stream") for k in kernels}
    assert copy_streams.isdisjoint(kernel_streams), "copies ran on the compute stream"
    # Every copy after the first (which nothing precedes) runs at least half its duration
    # while kernels run: against the union of the kernels' intervals, not any single one
    # (with TF32 or a faster GPU each matmul is shorter than the copy).
    busy = [(k["ts"], k["ts"] + k["dur"]) for k in kernels]
    later = sorted(copies, key=lambda e: e["ts"])[1:]
    hidden = [overlap_length((c["ts"], c["ts"] + c["dur"]), busy) >= 0.5 * c["dur"] for c in later]
    assert sum(hidden) >= len(later) - 1, f"{sum(hidden)} of {len(later)} copies overlapped"


def test_callback_on_cuda_delivers_the_same_batches_and_measures_exposure(tmp_path):

    from gpu_busy.callbacks import StreamPrefetcher
    from tests.prefetch.test_stream_prefetcher import Numbers, Reads, Recorder

    def fit(callbacks, pin):
        Reads.count = 0

        class Model(Recorder):
            def train_dataloader(self):
                return torch.utils.data.DataLoader(self.train_set, batch_size=4, pin_memory=pin)

        model = Model(train=Numbers(40), val=Numbers(8, offset=100))
        quiet_trainer(
            accelerator="gpu",
            max_epochs=2,
            val_check_interval=0.5,
            default_root_dir=tmp_path,
            callbacks=callbacks,
        ).fit(model)
        return model.seen, Reads.count

    plain = fit([], pin=True)
    prefetch = StreamPrefetcher()
    assert fit([prefetch], pin=True) == plain
    summary = prefetch.report
    assert summary["exposed_copy_ms"] is not None and summary["hidden_copy_pct"] is not None
    assert summary["pageable_batches"] == 0

    # Pageable batches: the same results, a warning once, and they are counted.
    unpinned = StreamPrefetcher()
    with pytest.warns(UserWarning, match="pin_memory=True") as record:
        assert fit([unpinned], pin=False) == plain
    assert sum("pin_memory=True" in str(w.message) for w in record) == 1
    assert unpinned.report["pageable_batches"] > 0


# -- sync detection on CUDA ------------------------------------------------------------


def _line_of(marker: str) -> int:
    import inspect

    source, start = inspect.getsourcelines(inspect.currentframe().f_back.f_code)
    return start + next(i for i, line in enumerate(source) if marker in line)


def test_detect_syncs_on_cuda_names_each_op_and_line():
    from gpu_busy.syncs import detect_syncs

    x = torch.randn(64, device="cuda")
    torch.cuda.synchronize()
    with detect_syncs(device_type="cuda") as rec:
        x[0].item()  # sync: item
        x.cpu()  # sync: cpu
        x[x > 0]  # sync: mask
        torch.nonzero(x)  # sync: nonzero
        torch.cuda.synchronize()  # sync: synchronize
        # clean: none of these waits for the device
        y = torch.where(x > 0, x, 0.0) + x.index_select(0, torch.arange(64, device="cuda"))
        x.masked_fill(x > 0, 1.0).nonzero_static(size=4)
        _ = x.shape, x.dtype
        (y.sum() * 2).exp_()
    ops = [e.op for e in rec.events]
    assert len(ops) == 5, [str(e) for e in rec.events]
    assert [e.lineno for e in rec.events] == [
        _line_of(f"# sync: {name}") for name in ("item", "cpu", "mask", "nonzero", "synchronize")
    ]
    assert all(e.filename == __file__ for e in rec.events)
    assert torch.cuda.get_sync_debug_mode() == 0, "the debug mode was not restored"


def test_cuda_debug_mode_catches_a_sync_missing_from_the_table(monkeypatch):
    from gpu_busy.syncs import detect_syncs
    from gpu_busy.syncs.rules import ATEN_RULES

    monkeypatch.delitem(ATEN_RULES, torch.ops.aten.nonzero)  # pretend it is unknown
    x = torch.randn(64, device="cuda")
    torch.cuda.synchronize()
    with detect_syncs(device_type="cuda") as rec:
        x.nonzero()  # the debug mode's warning names this line
    (event,) = rec.events
    assert "CUDA sync debug" in event.op and event.lineno == _line_of("x.nonzero()  # the")
    assert torch.cuda.get_sync_debug_mode() == 0


class ErrorOnSteadySyncs(pl.Callback):
    """Arms set_sync_debug_mode("error") from the end of step N-1 to the end of step N for
    every steady step N (neither N nor N-1 a logging step): any sync there raises."""

    armed_steps = 0

    def _disarm(self, *args):
        torch.cuda.set_sync_debug_mode(0)

    on_validation_start = on_train_epoch_end = on_train_end = _disarm

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from gpu_busy.lightning_compat import is_logging_step, logger_step

        torch.cuda.set_sync_debug_mode(0)
        this_logged = is_logging_step(trainer)  # step N logs if (logger_step + 1) % every == 0
        next_logs = (logger_step(trainer) + 2) % trainer.log_every_n_steps == 0
        last = batch_idx + 1 >= trainer.num_training_batches
        if not (this_logged or next_logs or last):
            type(self).armed_steps += 1
            torch.cuda.set_sync_debug_mode("error")


def test_default_config_steady_steps_run_under_sync_debug_error(in_tmp):
    importlib.import_module("tests.gpu.test_gpu").ErrorOnSteadySyncs.armed_steps = 0
    code = main(
        [
            "fit", "--config", DEFAULT, "--config", DEBUG,
            "--trainer.limit_train_batches=16", "--trainer.max_epochs=2",
            "--trainer.log_every_n_steps=8", "--data.num_workers=2",
            "--trainer.callbacks+=tests.gpu.test_gpu.ErrorOnSteadySyncs",
        ]
    )  # fmt: skip
    assert code == 0
    # The CLI imports the callback by its dotted path: pytest may hold this file under
    # another module name, so read the count from the class the CLI used.
    used = importlib.import_module("tests.gpu.test_gpu").ErrorOnSteadySyncs
    assert used.armed_steps >= 20
    assert torch.cuda.get_sync_debug_mode() == 0


def test_idle_time_recovers_injected_host_delays_by_events_and_by_trace():
    """After draining the queue the host waits d ms: both methods see d, as a sync stall."""
    from bench.idle import injected_delays

    for row in injected_delays(torch.device("cuda"), steps=20):
        tol = row["tolerance_ms"]  # max(0.1 ms, 5% of the step)
        assert abs(row["event_error_ms"]) <= tol, row
        assert row["trace_idle_ms"] is not None and abs(row["trace_error_ms"]) <= tol, row
        if row["delay_ms"] >= 1:
            assert row["event_causes_ms"]["sync_stall"] >= 0.9 * row["delay_ms"], row


class _DrainThenWait(pl.Callback):
    """Listed before the monitor: drains the queue, then keeps the host busy ``ms``."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        torch.cuda.synchronize()
        end = time.perf_counter() + self.ms / 1e3
        while time.perf_counter() < end:
            pass


def test_an_injected_delay_through_fit_with_the_default_callbacks_is_a_sync_stall():
    """The same check as above through Trainer.fit: Lightning's hook order, the prefetcher,
    the sync detector, a DataLoader."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from gpu_busy.callbacks import IdleTimeMonitor, RunSummary, StreamPrefetcher, SyncPointDetector

    class Spin(BoringModel):
        def training_step(self, batch, batch_idx):
            torch.cuda._sleep(5_000_000)  # a few ms of queued work per step
            return super().training_step(batch, batch_idx)

    def fit(delay_ms: float) -> dict:
        monitor = IdleTimeMonitor(warmup_steps=5, picture=False, log_stats=False)
        trainer = quiet_trainer(
            accelerator="gpu",
            max_epochs=1,
            limit_train_batches=40,
            limit_val_batches=0,
            callbacks=[
                StreamPrefetcher(),
                SyncPointDetector(),
                _DrainThenWait(delay_ms),
                monitor,
                RunSummary(),
            ],
        )
        trainer.fit(Spin())
        return monitor.report["mean"]

    # The drained GPU waits the delay plus the loop's own work between steps, measured
    # here by the same fit without the delay; 10% of the delay covers the timers' jitter.
    loop_ms = fit(0.0)["idle_ms"]
    delay_ms = 5.0
    mean = fit(delay_ms)
    assert delay_ms <= mean["idle_ms"] <= delay_ms + loop_ms + 0.1 * delay_ms, (loop_ms, mean)
    assert mean["idle_sync_stall_ms"] >= 0.9 * delay_ms, mean


def test_a_prefetched_batch_is_not_overwritten_while_the_compute_stream_still_reads_it():
    """record_stream at work: without it the allocator hands a freed batch's block to the
    next side-stream copy while the compute stream has not yet read it."""
    from gpu_busy.prefetch import PrefetchIterator, StreamCopier

    n = 1 << 22
    batches = [torch.full((n,), float(i)).pin_memory() for i in range(8)]
    copier = StreamCopier("cuda")
    sums = []
    for x in PrefetchIterator(batches, copier, depth=1):
        torch.cuda._sleep(20_000_000)  # the compute stream reaches the read below late
        sums.append(x.sum())
        del x  # the next call issues the copy after next, into whatever block is free
    copier.close()
    assert [s.item() for s in sums] == [float(i) * n for i in range(8)]


def test_idle_monitor_on_cuda_times_with_events_and_traces_device_work(in_tmp):
    import json
    from pathlib import Path

    code = main(
        [
            "fit", "--config", DEFAULT, "--config", DEBUG,
            "--trainer.limit_train_batches=24", "--trainer.log_every_n_steps=8",
            '--trainer.callbacks+={"class_path": "gpu_busy.callbacks.IdleTimeMonitor",'
            ' "init_args": {"trace_every_n_steps": 10, "trace_steps": 3}}',
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads(Path("runs/debug/version_0/idle.json").read_text())
    assert report["clock"] == "cuda events"
    mean = report["mean"]
    assert mean["device_ms"] > 0 and mean["idle_sync_stall_ms"] is not None
    assert mean["cuda_syncs_per_batch"] is not None
    trace = report["traces"][0]
    assert trace["device_events"] > 0 and trace["busy_ms"] > 0
    assert trace["span_ms"] == pytest.approx(trace["busy_ms"] + trace["idle_ms"])
    assert torch.cuda.get_sync_debug_mode() == 0  # the monitor's sync marks were undone


# -- the sync detector against CUDA's own sync debug mode, case by case --------------------


def _cuda_waits(run) -> bool:
    """Whether ``run`` makes the host wait, by CUDA's own account ("error" mode raises)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    except RuntimeError as e:
        if "called a synchronizing CUDA operation" not in str(e):
            raise
        return True
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return False


def _case_ids():
    from tests.helpers.sync_cases import CASES

    return CASES, [c.name for c in CASES]


@pytest.mark.parametrize("case", _case_ids()[0], ids=_case_ids()[1])
def test_the_detector_agrees_with_cudas_sync_debug_mode(case):
    from gpu_busy.syncs import detect_syncs
    from tests.helpers.sync_cases import Tensors

    t = Tensors("cuda")
    torch.cuda.synchronize()
    with detect_syncs(device_type="cuda") as rec:
        case.run(t)
    assert rec.internal_errors == 0
    fresh = Tensors("cuda")  # made before the debug mode is armed: their copies are setup
    waits = _cuda_waits(lambda: case.run(fresh))
    assert waits == bool(case.syncs), "the case list is wrong about this call on CUDA"
    assert len(rec.events) == case.syncs, [str(e) for e in rec.events]


def _fixes():
    from tests.helpers.sync_fixes import FIXES

    followed = [f for f in FIXES if f.after is not None]
    return followed, [f.name for f in followed]


@pytest.mark.parametrize("fix", _fixes()[0], ids=_fixes()[1])
def test_a_fix_followed_as_printed_does_not_wait_on_cuda(fix):
    """tests/syncs/test_sync_fixes.py on CUDA, by CUDA's own account."""
    from gpu_busy.syncs import detect_syncs
    from tests.helpers.sync_fixes import FixTensors

    t = FixTensors("cuda")
    torch.cuda.synchronize()
    assert not _cuda_waits(lambda: fix.after(t))
    with detect_syncs(device_type="cuda") as rec:
        fix.after(FixTensors("cuda"))
    assert [str(e) for e in rec.events] == []


def main(args: list[str]) -> int:
    """The entry point, where it can be imported (the test skips where it cannot)."""
    return cli_main()(args)


# -- CUDA's sync warnings, one event each; the debug mode armed only where it is read -------
# (their CPU stand-ins: tests/syncs/test_cuda_route.py)


def test_stream_synchronize_and_a_backward_sync_are_one_event_each_on_cuda():
    from gpu_busy.syncs import detect_syncs

    x = torch.randn(64, device="cuda", requires_grad=True)
    mask = torch.arange(64, device="cuda") % 2 == 0
    torch.cuda.synchronize()
    with detect_syncs(device_type="cuda") as rec:
        torch.cuda.current_stream().synchronize()  # sync: stream
        y = x[mask]  # sync: mask (and its backward)
        y.sum().backward()
        torch.where(mask)  # sync: where
    lines = [(e.phase, e.lineno) for e in rec.events]
    assert lines == [
        ("forward", _line_of("# sync: stream")),
        ("forward", _line_of("# sync: mask")),
        ("backward", _line_of("# sync: mask")),
        ("forward", _line_of("# sync: where")),
    ], [str(e) for e in rec.events]


class _OneItemPerStep(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch).sum()
        self.seen = loss.item()  # one sync per step
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(64, 32), batch_size=8)


class _CudaModeSpy(pl.Callback):
    def __init__(self) -> None:
        self.modes: dict[str, set[int]] = {}

    def _see(self, where: str) -> None:
        self.modes.setdefault(where, set()).add(torch.cuda.get_sync_debug_mode())

    def on_train_batch_start(self, *args):
        self._see("step")

    def on_validation_batch_start(self, *args, **kwargs):
        self._see("validation")

    def on_train_epoch_end(self, *args):
        self._see("epoch end")


def test_a_cuda_fit_reports_one_event_per_sync_and_arms_the_mode_only_in_steps(tmp_path):
    from gpu_busy.callbacks import IdleTimeMonitor, SyncPointDetector

    spy = _CudaModeSpy()
    detector = SyncPointDetector(first_steps=16, log_stats=False)  # all 16 steps watched
    trainer = quiet_trainer(
        accelerator="gpu",
        max_epochs=2,
        default_root_dir=tmp_path,
        callbacks=[IdleTimeMonitor(picture=False, log_stats=False), detector, spy],
    )
    trainer.fit(_OneItemPerStep())
    assert detector.totals.watched == 16
    assert detector.totals.syncs == detector.totals.watched, detector.table.render()
    assert spy.modes["step"] == {1} and spy.modes["epoch end"] == {0}, spy.modes
    assert torch.cuda.get_sync_debug_mode() == 0


def _sleep_cycles_per_ms() -> float:
    for _ in range(3):  # raise the clock first
        torch.cuda._sleep(10_000_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


class _HostBeforeStep(pl.Callback):
    """Drains the GPU, then keeps the host busy ``ms`` in on_train_batch_start."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def on_train_batch_start(self, *args) -> None:
        torch.cuda.synchronize()
        end = time.perf_counter() + self.ms / 1e3
        while time.perf_counter() < end:
            pass


class _KernelsAfterStep(pl.Callback):
    """Enqueues ``ms`` of device work in on_train_batch_end, as an EMA update does, timing
    each with events: the clock the cycles were counted at is not the one they run at (on
    a GPU machine, 4 ms counted cold ran in 2.5 ms), so the test uses what ran. (A hook
    that syncs first hides part of its kernels behind its own wait: the monitor proves
    only the device time its host time does not explain, docs/ARCHITECTURE.md.)"""

    def __init__(self, ms: float) -> None:
        self.cycles = int(ms * _sleep_cycles_per_ms())
        self.timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def on_train_batch_end(self, *args) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(self.cycles)
        end.record()
        self.timed.append((start, end))

    def mean_ms(self, skip: int) -> float:
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) for a, b in self.timed[skip:]]
        return sum(times) / len(times)


@pytest.mark.parametrize("callback", ["host before the step", "kernels after the step"])
def test_idle_causes_on_cuda_mean_what_they_say(callback):
    from lightning.pytorch.demos.boring_classes import BoringModel

    from gpu_busy.callbacks import IdleTimeMonitor

    ms = 4.0
    extra = _HostBeforeStep(ms) if callback == "host before the step" else _KernelsAfterStep(ms)
    monitor = IdleTimeMonitor(warmup_steps=5, picture=False, log_stats=False)
    trainer = quiet_trainer(
        accelerator="gpu",
        max_epochs=1,
        limit_train_batches=30,
        limit_val_batches=0,
        callbacks=[extra, monitor],
    )
    trainer.fit(BoringModel())
    mean = monitor.report["mean"]
    if callback == "host before the step":
        assert mean["transfer_ms"] >= ms and mean["copy_ms"] < 0.5, mean
    else:  # the kernels are device time; what is left idle is the loop's own
        ran = extra.mean_ms(skip=5)
        assert ran >= 1.0, ran
        assert mean["device_ms"] >= 0.9 * ran and mean["idle_ms"] < 0.5 * ran, (ran, mean)


def test_a_nccl_barrier_prints_no_sync_warning_while_a_listener_holds_warn(capfd):
    """One NCCL rank is enough for a barrier: its Work.wait stream-synchronizes, bound
    without a Python warning handler, so under "warn" its warning would go to stderr."""
    import torch.distributed as dist

    from gpu_busy.cuda_sync_warnings import cuda_sync_warnings

    torch.zeros(1, device="cuda")  # CUDA initialised: the listener arms the mode
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        heard = []
        with cuda_sync_warnings(lambda: heard.append(1)):
            assert torch.cuda.get_sync_debug_mode() == 1
            dist.barrier(device_ids=[torch.cuda.current_device()])
        torch.cuda.synchronize()
        err = capfd.readouterr().err
        assert "synchronizing CUDA operation" not in err, err[-2000:]
        assert heard == [] and torch.cuda.get_sync_debug_mode() == 0
    finally:
        dist.destroy_process_group()


def test_a_gpu_run_told_to_simulate_keeps_lightnings_copies_to_the_host_blocking(tmp_path):
    from lightning.fabric.utilities import apply_func
    from lightning.pytorch.demos.boring_classes import BoringModel

    from gpu_busy.callbacks import SyncPointDetector

    seen = []

    class Spy(pl.Callback):
        def on_train_batch_start(self, *args) -> None:
            seen.append(apply_func._BLOCKING_DEVICE_TYPES)

    detector = SyncPointDetector(device_type="cpu")
    trainer = quiet_trainer(accelerator="gpu", max_steps=3, default_root_dir=tmp_path,
                            limit_val_batches=0, callbacks=[detector, Spy()])  # fmt: skip
    trainer.fit(BoringModel())
    assert seen and all("cpu" in blocking for blocking in seen), seen
