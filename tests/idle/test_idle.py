"""Idle time: interval maths, trace analysis on known answers, the step timer's control flow
(host clocks, and CUDA's event logic with scripted events), the report, and the callback."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from gpu_busy.callbacks import IdleTimeMonitor
from gpu_busy.idle import (
    IdleStats,
    StepSeries,
    StepTimer,
    TimedReads,
    analyze_trace,
)
from gpu_busy.idle.causes import names
from gpu_busy.idle.intervals import gaps, merge, overlap_length, union_length
from gpu_busy.report.idle import build_report, render_table
from gpu_busy.report.picture import batch_breakdown
from tests.conftest import DEBUG, DEFAULT, cli_main
from tests.helpers.scripted_gpu import ScriptedGPU
from tests.helpers.trainers import quiet_trainer

# -- intervals -----------------------------------------------------------------------


def test_interval_union_overlap_and_gaps():
    assert merge([(5, 6), (0, 4), (2, 3), (4, 4.5), (9, 9)]) == [(0, 4.5), (5, 6)]
    assert union_length([(0, 4), (2, 6), (8, 9), (8, 9)]) == 7
    assert overlap_length((3, 10), [(0, 4), (8, 12)]) == 3
    assert overlap_length((3, 10), []) == 0
    # one interval (the usual gap, one DataLoader read): the same as the general rule
    for one in [(0, 4), (4, 5), (11, 12), (5, 5), (6, 2), (2, 12)]:
        assert overlap_length((3, 10), [one]) == union_length(
            [(max(3, one[0]), min(10, one[1]))]
        ), one
    assert gaps([(0, 4.5), (5, 6), (6, 7)]) == [(4.5, 5)]


# -- analyze_trace on synthetic traces with known answers ------------------------------


def kernel(ts, dur, stream=7, name="void gemm_kernel", corr=None, cat="kernel", device=0):
    args = {} if corr is None else {"correlation": corr}
    return {"ph": "X", "cat": cat, "name": name, "pid": device, "tid": stream, "ts": ts,
            "dur": dur, "args": args}  # fmt: skip


def host(ts, dur, name, cat="cpu_op", corr=None, tid=1):
    args = {} if corr is None else {"correlation": corr}
    return {"ph": "X", "cat": cat, "name": name, "pid": 100, "tid": tid, "ts": ts,
            "dur": dur, "args": args}  # fmt: skip


def launch(ts, corr, name="cudaLaunchKernel", dur=2.0):
    return host(ts, dur, name, cat="cuda_runtime", corr=corr)


def test_busy_is_the_union_over_streams_with_memcpy_memset_and_cpu_events_ignored():
    events = [
        kernel(0, 10, stream=7),
        kernel(5, 10, stream=8),  # overlaps the first on another stream: 0..15 busy
        kernel(20, 5, cat="gpu_memcpy", name="Memcpy HtoD (Pinned -> Device)"),
        kernel(25, 2, cat="gpu_memset", name="Memset (Device)"),  # touches the memcpy
        kernel(30, 5, stream=7),
        kernel(30, 5, stream=9),  # identical interval: counted once
        kernel(40, 10, stream=7),
        kernel(42, 2, stream=8),  # nested inside the previous
        host(-100, 400, "aten::conv2d"),  # CPU activity: not device activity
        {"ph": "X", "cat": "python_function", "name": "train.py(12): step", "pid": 100,
         "tid": 1, "ts": 0, "dur": 500},
        {"ph": "i", "cat": "kernel", "name": "instant, not a span", "pid": 0, "tid": 7, "ts": 99},
    ]  # fmt: skip
    r = analyze_trace({"traceEvents": events})
    assert r.span_ms == pytest.approx(0.050)
    assert r.busy_ms == pytest.approx((15 + 7 + 5 + 10) / 1e3)
    assert r.idle_ms == pytest.approx(0.013)
    assert r.memcpy_ms == pytest.approx(0.005) and r.memset_ms == pytest.approx(0.002)
    assert r.compute_ms == pytest.approx((15 + 5 + 10) / 1e3)
    assert r.device_events == 8 and r.streams == 3
    assert sum(r.causes.values()) == pytest.approx(r.idle_ms)
    assert r.idle_pct == pytest.approx(26.0)


def test_nccl_kernels_are_reported_apart_from_compute():
    events = [
        kernel(0, 20, stream=20, name="ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)"),
        kernel(0, 5, stream=7),
        kernel(30, 10, stream=7),
    ]
    r = analyze_trace({"traceEvents": events})
    assert r.busy_ms == pytest.approx(0.030) and r.idle_ms == pytest.approx(0.010)
    assert r.nccl_ms == pytest.approx(0.020)
    assert r.compute_ms == pytest.approx(0.015)
    # Time covered only by NCCL (5..20) counts as idle when NCCL is left out.
    assert r.idle_without_nccl_ms == pytest.approx((40 - 15) / 1e3)


def test_gaps_are_host_waits_only_when_the_next_kernel_was_launched_after_the_last_ended():
    events = [
        launch(-5, 1), kernel(0, 10, corr=1),
        launch(25, 2), kernel(30, 10, corr=2),  # launched at 25 > 10: host wait of 20
        launch(35, 3), kernel(50, 10, corr=3),  # launched at 35 < 40: the GPU's own wait
    ]  # fmt: skip
    r = analyze_trace({"traceEvents": events})
    assert r.idle_ms == pytest.approx(0.030)
    assert r.host_wait_ms == pytest.approx(0.020)
    assert r.causes["other"] == pytest.approx(0.030)  # no data, sync or operator around


def test_host_wait_causes_data_wait_sync_stall_and_launch_bound():
    events = [
        launch(-5, 1), kernel(0, 10, corr=1),
        # gap 10..30: the host was in a DataLoader read 8..22, then in a sync until 10.5
        host(8, 14, "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
             cat="user_annotation"),
        host(2, 8.5, "cudaStreamSynchronize", cat="cuda_runtime"),
        launch(25, 2), kernel(30, 10, corr=2),
        # gap 40..60: the host was inside aten::add (40 < 35+30) when the GPU ran dry
        host(35, 28, "aten::add"), launch(58, 3), kernel(60, 5, corr=3),
        # gap 65..80: the host was between operators
        host(70, 20, "aten::mul"), launch(75, 4), kernel(80, 5, corr=4),
    ]  # fmt: skip
    r = analyze_trace({"traceEvents": events})
    assert r.host_wait_ms == pytest.approx((20 + 20 + 15) / 1e3)
    assert r.causes["data_wait"] == pytest.approx(0.012)  # 10..22 of the first gap
    assert r.causes["sync_stall"] == pytest.approx(0.008)  # the rest of it
    assert r.causes["launch_bound"] == pytest.approx(0.020)
    assert r.causes["other"] == pytest.approx(0.015)
    assert sum(r.causes.values()) == pytest.approx(r.idle_ms)


def test_per_profiler_step_figures_and_the_gap_between_steps():
    events = [
        host(0, 50, "ProfilerStep#3", cat="user_annotation"),
        host(50, 50, "ProfilerStep#4", cat="user_annotation"),
        kernel(5, 25, cat="gpu_user_annotation", name="ProfilerStep#3"),  # the GPU's mirror
        launch(1, 1), kernel(5, 10, corr=1),
        launch(2, 2), kernel(20, 10, corr=2),  # in-step idle 15..20, launched early
        launch(60, 3), kernel(62, 8, corr=3),  # step 4 starts 32 after step 3's last end
        launch(61, 4), kernel(66, 8, corr=4, stream=8),  # overlapping: busy 62..74
    ]  # fmt: skip
    r = analyze_trace({"traceEvents": events})
    three, four = r.steps
    assert three.name == "ProfilerStep#3" and three.device_events == 2
    assert (three.span_ms, three.busy_ms, three.idle_ms) == pytest.approx((0.025, 0.020, 0.005))
    assert three.gap_before_ms is None
    assert (four.span_ms, four.busy_ms, four.idle_ms) == pytest.approx((0.012, 0.012, 0.0))
    assert four.gap_before_ms == pytest.approx(0.032)
    assert four.causes["other"] == pytest.approx(0.032)  # host wait, host doing nothing known
    assert r.idle_ms == pytest.approx(0.005 + 0.032)


def test_trace_from_a_path_a_gzipped_path_or_a_list(tmp_path):
    trace = {"traceEvents": [kernel(0, 10), kernel(20, 10)]}
    plain, zipped = tmp_path / "t.json", tmp_path / "t.json.gz"
    plain.write_text(json.dumps(trace))
    with gzip.open(zipped, "wt") as f:
        json.dump(trace, f)
    for source in (plain, str(plain), zipped, trace, trace["traceEvents"]):
        assert analyze_trace(source).idle_ms == pytest.approx(0.010)
    empty = analyze_trace({"traceEvents": []})
    assert (empty.span_ms, empty.busy_ms, empty.idle_ms, empty.idle_pct) == (0, 0, 0, None)
    with pytest.raises(ValueError, match="traceEvents"):
        analyze_trace(42)


def test_a_real_cpu_profiler_trace(tmp_path):
    """The PyTorch profiler's own export parses: its steps are found; no device activity."""
    from torch.profiler import ProfilerActivity, profile, schedule

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "cpu.pt.trace.json"
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=1, active=3, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
    ) as prof:
        for _ in range(5):
            loss = model(torch.randn(16, 32)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    r = analyze_trace(path)
    assert [s.name for s in r.steps] == ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]
    assert r.device_events == 0 and (r.span_ms, r.busy_ms, r.idle_ms) == (0, 0, 0)
    assert all(s.device_events == 0 for s in r.steps)


# -- StepTimer on host clocks ----------------------------------------------------------


class HostClock:
    """A scripted ``time`` for the step timer: ``perf_counter`` reads it, ``sleep`` moves it.
    The figures come out exact, however loaded the machine is."""

    def __init__(self) -> None:
        self.s = 0.0

    def perf_counter(self) -> float:
        return self.s

    def sleep(self, seconds: float) -> None:
        self.s += seconds


@pytest.fixture
def host_clock(monkeypatch) -> HostClock:
    import gpu_busy.event_pool as event_pool
    import gpu_busy.idle.step_timer as step_timer

    clock = HostClock()
    monkeypatch.setattr(step_timer, "time", clock)
    monkeypatch.setattr(event_pool, "time", clock)  # the host-clock stand-ins for events
    return clock


def test_host_clock_timer_measures_data_wait_idle_and_step_time(host_clock):
    def loader():
        for i in range(5):
            host_clock.sleep(0.020)  # the DataLoader is slow
            yield i

    timer = StepTimer("cpu")
    done = []
    for _ in TimedReads(loader(), timer):
        timer.start_step()
        host_clock.sleep(0.010)
        timer.end_step()
        done += timer.poll()  # host clocks: complete at once
        host_clock.sleep(0.001)  # the loop's own work between steps
    assert [t.step for t in done] == [0, 1, 2, 3, 4]
    first, rest = done[0], done[1:]
    assert first.idle_ms is None and first.device_ms == pytest.approx(10)  # nothing before it
    for t in rest:
        assert t.loader_wait_ms == pytest.approx(20) and t.device_ms == pytest.approx(10)
        assert t.idle_ms == pytest.approx(21)  # the read, and the loop's own work
        assert t.causes["data_wait"] == pytest.approx(20)
        assert t.causes["other"] == pytest.approx(1)
        assert t.causes["sync_stall"] is None and t.causes["launch_bound"] is None
    stats = IdleStats()
    for t in done:
        stats.add_step(t)
    means = stats.means(cuda=False)
    assert stats.steps == 5 and stats.timed_steps == 4
    assert means["idle_sync_stall_ms"] is None and means["cuda_syncs_per_batch"] is None
    assert means["idle_pct"] == pytest.approx(100 * 21 / 31)


def test_the_last_steps_wait_is_the_read_that_ends_the_data(host_clock):
    # Lightning fetches one batch ahead: the gap before the last step holds only the read
    # that raises StopIteration (a DataLoader shutting its workers down). It is data time.
    def loader():
        yield from range(3)
        host_clock.sleep(0.020)

    timer = StepTimer("cpu")
    batches = iter(TimedReads(loader(), timer))
    current, done = next(batches), []
    while current is not None:
        upcoming = next(batches, None)  # the one-ahead fetch, in the gap before the step
        timer.start_step()
        host_clock.sleep(0.005)
        timer.end_step()
        done += timer.poll()
        current = upcoming
    last = done[-1]
    assert last.loader_wait_ms == pytest.approx(20)
    assert last.causes["data_wait"] == pytest.approx(last.idle_ms) == pytest.approx(20)


def test_a_broken_gap_gives_no_idle_figure():
    timer = StepTimer("cpu")
    timer.start_step()
    timer.end_step()
    timer.break_gap()  # e.g. validation ran here
    timer.start_step()
    timer.end_step()
    timer.start_step()
    timer.end_step()
    idle = [t.idle_ms for t in timer.poll()]
    assert idle[0] is None and idle[1] is None and idle[2] is not None


# -- StepTimer's CUDA logic, with scripted events -----------------------------------------


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    gpu = ScriptedGPU()
    return gpu, StepTimer(torch.device("cuda", 0), pool=gpu)


def test_cuda_timer_reads_back_lazily_and_holds_a_bounded_number_of_events(scripted):
    gpu, timer = scripted
    for step in range(5):
        base = 10.0 * step  # device ms: 2 ms idle, 1 ms transfer, 7 ms step
        gpu.times += [base + 2, base + 3, base + 10]
        timer.loader_wait(0.0, 0.0)
        timer.start_step()
        timer.end_step()
        assert timer.poll() == []  # the GPU has not got there yet: nothing blocks
        assert gpu.in_use == 3 * (step + 1)  # ready, start, end per step in flight
    gpu.now = 35.0  # the GPU has finished step 2 (ends at 30)
    done = timer.poll()
    assert [t.step for t in done] == [0, 1, 2]
    assert done[0].idle_ms is None  # no step before the first
    assert [(t.idle_ms, t.transfer_ms, t.device_ms) for t in done[1:]] == [(2, 1, 7)] * 2
    rest = timer.close()  # at the end of the run: waits for the rest
    assert [t.step for t in rest] == [3, 4]
    assert gpu.in_use == 0, "events leaked"


def test_a_window_read_asks_the_newest_ends_only_and_a_new_stream_its_own_marks(monkeypatch):
    streams = iter(["default", "default", "the user's"])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: next(streams))
    gpu = ScriptedGPU(capacity=256)
    timer = StepTimer(torch.device("cuda", 0), pool=gpu)

    def steps(first: int, n: int) -> None:
        for step in range(first, first + n):
            gpu.times += [10.0 * step + 2, 10.0 * step + 3, 10.0 * step + 10]
            timer.loader_wait(0.0, 0.0)
            timer.start_step()
            timer.end_step()

    steps(0, 20)
    gpu.now = 185.0  # the device has finished step 17 (it ends at 180), not 18
    done = timer.poll()
    # one stream completes its events in order: two ends asked, not 4 marks x 20 steps
    assert [t.step for t in done] == list(range(18)) and gpu.queries == 3
    timer.refresh_stream()  # the same stream: nothing changes
    steps(20, 2)
    timer.refresh_stream()  # the user's own stream from here: no gap across it is timed
    steps(22, 2)
    gpu.now, gpu.queries = 225.0, 0  # steps 18 to 21 done on the old stream, 22 not
    done = timer.poll()
    assert [t.step for t in done] == [18, 19, 20, 21]
    assert gpu.queries == 4 * 4 + 2  # the old stream's steps in full, then the newest ends
    gpu.now = 1e9
    assert [(t.step, t.idle_ms) for t in timer.poll()] == [(22, None), (23, 2.0)]


def test_cuda_timer_pool_exhaustion_leaves_steps_untimed_not_broken(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    gpu = ScriptedGPU(capacity=5)
    timer = StepTimer(torch.device("cuda", 0), pool=gpu)
    for step in range(4):
        gpu.times += [10.0 * step + 1, 10.0 * step + 9]
        timer.start_step()
        timer.end_step()
    done = timer.close()
    assert len(done) == 4 and timer.untimed >= 1
    assert any(t.device_ms is None for t in done) and gpu.in_use == 0


def _one_gap(scripted, *, gpu_drains_at, syncs=(), step_end_host=100.0, ready_host=110.0):
    """Step 0 ends (host) at ``step_end_host``; the GPU runs dry at ``gpu_drains_at`` (host
    clock, ms); the host records ready at ``ready_host``. Returns step 1's causes."""
    gpu, timer = scripted
    clock = iter([0.0, step_end_host, ready_host, ready_host + 1, ready_host + 10])
    marks = type("Marks", (), {"since": lambda self, t: [s / 1e3 for s in syncs]})()
    timer.sync_marks = marks
    import gpu_busy.idle.step_timer as st

    real = st.time.perf_counter
    st.time.perf_counter = lambda: next(clock) / 1e3
    try:
        idle = ready_host - max(gpu_drains_at, step_end_host)
        # device times: start 0, end 50 (any), ready 50 + idle, start 51 + idle, end 60 + idle
        gpu.times += [0.0, 50.0, 50.0 + idle, 51.0 + idle, 60.0 + idle]
        timer.start_step()
        timer.end_step()
        timer.loader_wait(ready_host / 1e3 - 0.002, ready_host / 1e3)  # 2 ms of data wait
        timer.start_step()
        timer.end_step()
    finally:
        st.time.perf_counter = real
    step1 = timer.close()[1]
    assert step1.idle_ms == pytest.approx(idle)
    return step1.causes


def test_cuda_causes_other_when_the_gpu_drained_while_the_host_was_between_steps(scripted):
    causes = _one_gap(scripted, gpu_drains_at=104.0)  # 6 ms idle, the last 2 in data
    assert causes == pytest.approx(
        {"data_wait": 2.0, "sync_stall": 0.0, "launch_bound": 0.0, "other": 4.0}
    )


def test_cuda_causes_sync_stall_when_a_sync_started_before_the_gpu_drained(scripted):
    causes = _one_gap(scripted, gpu_drains_at=104.0, syncs=[101.0])
    assert causes == pytest.approx(
        {"data_wait": 2.0, "sync_stall": 4.0, "launch_bound": 0.0, "other": 0.0}
    )


def test_cuda_causes_launch_bound_when_the_gpu_ran_dry_before_the_step_was_enqueued(scripted):
    causes = _one_gap(scripted, gpu_drains_at=95.0)  # dry before the host ended step 0
    assert causes == pytest.approx(
        {"data_wait": 2.0, "sync_stall": 0.0, "launch_bound": 8.0, "other": 0.0}
    )


def _two_steps(scripted, host, device):
    """Step 0 and step 1 through every mark, with the host clock and the device times
    scripted (ms), in the order the timer reads them: start 0, end 0, hooks done, ready,
    start 1, end 1."""
    gpu, timer = scripted
    import gpu_busy.idle.step_timer as st

    clock = iter(host)
    real = st.time.perf_counter
    st.time.perf_counter = lambda: next(clock) / 1e3
    try:
        gpu.times += list(device)
        timer.start_step()
        timer.end_step()
        timer.hooks_done()
        timer.loader_wait(host[3] / 1e3, host[3] / 1e3)
        timer.start_step()
        timer.end_step()
    finally:
        st.time.perf_counter = real
    return timer.close()[1]


def test_a_callbacks_host_time_before_the_step_is_not_copy_time(scripted):
    # The batch is at hand at once (100.05) while the GPU finishes step 0 (101); a
    # callback then spends 8 ms in on_train_batch_start; the 1 ms copy ran at 101, hidden
    # behind those 8 ms. The GPU waited 7 ms for the host, not for the copy.
    step = _two_steps(
        scripted,
        host=[0, 100, 100.02, 100.05, 108.05, 118.05],
        device=[0, 101, 101, 101, 108.05, 118.05],
    )
    assert step.transfer_ms == pytest.approx(7.05) and step.copy_ms == 0.0
    assert step.idle_ms == 0.0
    stats = IdleStats()
    stats.add_step(step)
    from gpu_busy.report.verdict import decide

    mean = stats.means(cuda=True)
    verdict = decide({"clock": "cuda events", "mean": mean, "ranks": [mean]})
    assert verdict.cause == "transfer" and "copies" not in verdict.line, verdict.line


def test_a_copy_that_outlasts_the_hosts_hooks_is_copy_time(scripted):
    # The same 8 ms of hooks, but a 12 ms copy: it holds the step 4 ms past them.
    step = _two_steps(
        scripted,
        host=[0, 100, 100.02, 110, 118, 128],
        device=[0, 100, 100.02, 110, 122, 132],
    )
    assert step.transfer_ms == pytest.approx(12.0) and step.copy_ms == pytest.approx(4.0)


def test_a_callbacks_device_work_after_the_step_is_not_idle(scripted):
    # The GPU runs 5 ms behind the host at the step's end; a callback's on_train_batch_end
    # (an EMA update) enqueues 3 ms of kernels in 0.05 ms; the GPU then idles until the
    # batch is ready at 110.
    step = _two_steps(
        scripted,
        host=[0, 100, 100.05, 110, 111, 120],
        device=[0, 105, 108, 110, 111, 120],
    )
    assert step.idle_ms == pytest.approx(2.05)  # not 5: the EMA's 2.95 ms are work
    assert step.device_ms == pytest.approx(9.0 + 2.95)
    assert step.causes["other"] == pytest.approx(2.05)


def test_a_callbacks_host_work_after_the_step_stays_idle(scripted):
    # 6 ms of logging in on_train_batch_end enqueue nothing: the GPU idles through them.
    step = _two_steps(
        scripted,
        host=[0, 100, 106, 110, 111, 120],
        device=[0, 100, 106, 110, 111, 120],
    )
    assert step.idle_ms == pytest.approx(10.0) and step.device_ms == pytest.approx(9.0)


# -- stats, series and the report ------------------------------------------------------


def test_idle_stats_travel_as_a_flat_list_and_series_stay_bounded():
    s = IdleStats(steps=3, timed_steps=2, idle_ms=4.0, device_ms=16.0, idle_data_wait_ms=4.0)
    assert IdleStats.from_list(s.as_list()) == s
    assert s.means(cuda=True)["idle_pct"] == pytest.approx(20.0)
    assert s.take() == IdleStats(steps=3, timed_steps=2, idle_ms=4.0, device_ms=16.0,
                                 idle_data_wait_ms=4.0) and s == IdleStats()  # fmt: skip
    from gpu_busy.idle import StepTiming

    series = StepSeries(capacity=64)
    for i in range(1000):
        series.add(StepTiming(i, 1.0, 0.0, 2.0, 0.0, 1.0, dict.fromkeys(names(), 0.25)))
    assert len(series.rows) < 64 and series.rows[-1][0] > 900


def test_report_gives_each_figures_rank_max_and_reads_na_for_gpu_figures_on_a_host_clock(
    tmp_path,
):
    fast = IdleStats(steps=10, timed_steps=10, idle_ms=10.0, device_ms=90.0, idle_other_ms=10.0)
    slow = IdleStats(steps=10, timed_steps=10, idle_ms=40.0, device_ms=60.0, idle_data_wait_ms=40.0)
    report = build_report([fast, slow], cuda=False, clock="host clock")
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert report["rank_max"]["idle_pct"] == pytest.approx(40.0)
    assert report["rank_max"]["device_ms"] == pytest.approx(9.0)  # rank 0's: per figure
    assert report["mean"]["idle_pct"] == pytest.approx(25.0)
    assert report["mean"]["idle_sync_stall_ms"] is None
    text = "\n".join(render_table(report))
    assert "rank max" in text and "n/a" in text
    assert "2.50 ms (25.0%)" in text and "4.00 ms (40.0%)" in text  # idle: mean, rank max
    json.dumps(report)  # JSON-ready
    rows = {0: [[float(i), 0.5, 0.1, 9.0, 1.0, 0.0, 0.0, 0.5] for i in range(20)]}
    path = batch_breakdown(rows, tmp_path / "idle.png")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # One timed batch and a host clock's causes only: still a picture of bars, not empty.
    one = batch_breakdown({0: rows[0][:1]}, tmp_path / "one.png", causes=("data_wait", "other"))
    assert one is not None and one.stat().st_size > 10_000


def test_a_cuda_report_gives_syncs_as_a_count_and_times_in_ms():
    # A GPU machine's table once read "syncs per batch (CUDA sync debug, all)  1.00 ms".
    stats = IdleStats(steps=10, timed_steps=10, idle_ms=10.0, device_ms=90.0, syncs=30)
    text = render_table(build_report([stats], cuda=True, clock="cuda events"))
    (syncs,) = [line for line in text if line.startswith("syncs per batch")]
    assert syncs.split()[-1] == "3.00", syncs
    assert any(line.startswith("idle between steps") and " ms (" in line for line in text)


def test_the_tables_columns_never_touch_with_four_digit_times_and_two_ranks():
    # A DDP run's table once read "814.77 ms (98.8%) 815.01 ms (98.8%)", and a four-digit
    # time ran its two columns together.
    fast = IdleStats(steps=4, timed_steps=4, idle_ms=40.0, device_ms=7_000.0, syncs=4)
    slow = IdleStats(steps=4, timed_steps=4, idle_ms=80.0, device_ms=49_000.0, syncs=4)
    lines = render_table(build_report([fast, slow], cuda=True, clock="cuda events"))
    header = lines[1]
    mean_end = header.index("mean") + len("mean")
    max_end = header.index("rank max") + len("rank max")
    for line in lines[2:]:
        # label, mean, rank max (and a threshold): two spaces at least between any two
        columns = re.split(r" {2,}", line.strip())
        assert len(columns) in (3, 4), line
        # each cell right-aligned under its heading
        assert line[:mean_end].endswith(columns[1]) and line[:max_end].endswith(columns[2])
    step = next(line for line in lines if line.startswith("the step itself"))
    assert re.split(r" {2,}", step)[1:] == ["7000.00 ms (99.8%)", "12250.00 ms (99.8%)"]


# -- the callback, in a real fit on the CPU ------------------------------------------------


@pytest.mark.slow  # about 5 s on 2 cores: a fit of many batches
def test_idle_monitor_logs_reports_and_captures_a_profiler_window(tmp_path, monkeypatch):
    main = cli_main()

    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "fit", "--config", DEFAULT, "--config", DEBUG,
            "--trainer.limit_train_batches=12", "--trainer.max_epochs=2",
            "--trainer.log_every_n_steps=4",
            '--trainer.callbacks+={"class_path": "gpu_busy.callbacks.IdleTimeMonitor",'
            ' "init_args": {"trace_every_n_steps": 8, "trace_steps": 2, "warmup_steps": 2}}',
        ]
    )  # fmt: skip
    assert code == 0
    run = tmp_path / "runs" / "debug" / "version_0"
    report = json.loads((run / "idle.json").read_text())
    assert report["clock"] == "host clock" and report["world_size"] == 1
    mean = report["mean"]
    assert mean["idle_pct"] is not None and 0 <= mean["idle_pct"] < 100
    assert mean["idle_sync_stall_ms"] is None and mean["idle_launch_bound_ms"] is None
    assert sum(mean[f"idle_{c}_ms"] or 0 for c in names()) == pytest.approx(mean["idle_ms"])
    # The prefetcher and the sync detector write their own files, through the same writer.
    assert json.loads((run / "prefetch.json").read_text())["batches"] == 24
    assert json.loads((run / "syncs.json").read_text())["summary"]["watched_batches"] >= 1
    # Profiler windows at steps 8 and 16 (plus a warm-up step each): saved and analysed.
    traces = sorted((run / "traces").glob("rank0-step*.pt.trace.json"))
    assert [t["first_step"] for t in report["traces"]] == [9, 17]
    assert len(traces) == 2 and report["traces"][0]["device_events"] == 0
    assert (run / "idle.png").read_bytes()[:4] == b"\x89PNG"
    header = (run / "metrics.csv").read_text().splitlines()[0]
    assert "idle/idle_pct" in header and "idle/loader_wait_ms" in header
    assert "idle/idle_sync_stall_ms" not in header  # n/a on a host clock: not logged as a number


# -- profiler windows, with a fake profiler ----------------------------------------------


class FakeProfiler:
    """Calls on_trace_ready after one warm-up and ``steps`` recorded steps, like
    torch.profiler's schedule(wait=0, warmup=1, active=steps)."""

    made: list[FakeProfiler] = []

    def __init__(self, on_trace_ready, steps: int = 2) -> None:
        self.on_trace_ready, self.steps = on_trace_ready, steps
        self.calls, self.started, self.stopped = 0, False, False
        FakeProfiler.made.append(self)

    def start(self) -> None:
        self.started = True

    def step(self) -> None:
        self.calls += 1
        if self.calls == 1 + self.steps and self.on_trace_ready is not None:
            self.on_trace_ready(self)

    def stop(self) -> None:
        self.stopped = True

    def export_chrome_trace(self, path: str) -> None:
        kernel = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "dur": 10}
        Path(path).write_text(json.dumps({"traceEvents": [{**kernel, "ts": 0}]}))


def test_profiler_windows_open_every_n_steps_save_analyse_and_mark_the_steps(tmp_path):
    from gpu_busy.idle.profiler_windows import ProfilerWindows

    FakeProfiler.made.clear()
    windows = ProfilerWindows(every_n_steps=5, folder=tmp_path, make_profiler=FakeProfiler)
    closed_at = [n for n in range(1, 13) if windows.after_step(n)]
    # Opened after step 5 (the 5th ended), warm-up step 5, records 6 and 7, closes after 8.
    assert closed_at == [8] and len(FakeProfiler.made) == 2  # the second opened after 10
    (result,) = windows.results
    assert result["first_step"] == 6 and result["device_events"] == 1
    assert Path(result["path"]).name == "rank0-step6.pt.trace.json"
    assert [s for s in range(12) if windows.profiled(s)] == [5, 6, 7, 10, 11]
    # Validation cuts the open window: dropped, not saved, its steps still marked.
    assert windows.stop(12) and FakeProfiler.made[1].stopped
    assert len(windows.results) == 1 and windows.profiled(11) and not windows.profiled(12)
    assert not windows.stop(12)  # nothing open


def test_profiler_windows_on_request_or_trigger_file_and_without_a_folder(tmp_path):
    from gpu_busy.idle.profiler_windows import ProfilerWindows

    trigger = tmp_path / "TRACE"
    windows = ProfilerWindows(trigger=trigger, make_profiler=FakeProfiler)
    assert not any(windows.after_step(n) for n in range(1, 20))  # never on its own
    trigger.touch()
    windows.look_for_trigger()
    assert [n for n in range(20, 25) if windows.after_step(n)] == [23]
    windows.request()
    assert [n for n in range(25, 30) if windows.after_step(n)] == [28]
    assert [r["path"] for r in windows.results] == [None, None]  # analysed, not kept
    assert list(tmp_path.iterdir()) == [trigger]


class _SlowEndOfBatch(pl.Callback):
    """Listed before the monitor: 20 ms of between-step work (a save, a logging read)."""

    def __init__(self, clock: HostClock) -> None:
        self.clock = clock

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.clock.sleep(0.02)


def test_the_timer_brackets_the_step_itself_wherever_the_monitor_is_listed(tmp_path, host_clock):
    monitor = IdleTimeMonitor(warmup_steps=1, picture=False, log_stats=False)
    trainer = quiet_trainer(
        max_epochs=1,
        limit_train_batches=8,
        limit_val_batches=0,
        callbacks=[_SlowEndOfBatch(host_clock), monitor],
    )
    trainer.fit(BoringModel())
    mean = monitor.report["mean"]
    # The other callback's 20 ms is not the step's: it is idle between steps. (The scripted
    # clock moves only in that callback, so the step itself takes no time.)
    assert mean["device_ms"] == 0 and mean["idle_other_ms"] == pytest.approx(20), mean
    assert len(trainer.callbacks) == 2  # the step marks are gone after the fit


def _standin_synchronize(monkeypatch, calls: list):
    """A stand-in owner of an explicit synchronize() as the only entry point: CPU CI has no
    CUDA to call (set before cuda_standin.install(), which adds its stream and restores)."""
    from types import SimpleNamespace

    from gpu_busy import cuda_sync_warnings

    owner = SimpleNamespace(synchronize=lambda: calls.append("synced"))
    row = (owner, "synchronize", "torch.cuda.synchronize()", "cuda", False)
    monkeypatch.setattr(cuda_sync_warnings, "synchronize_calls", lambda: [row])
    return owner


def test_explicit_synchronize_calls_are_marked_at_their_start_and_restored(monkeypatch):
    # torch.cuda.synchronize() and Event.synchronize() never consult CUDA's sync debug
    # mode: SyncMarks hears them from the shared wrapper, as they start.
    import time

    from gpu_busy.idle.sync_marks import SyncMarks
    from tests.helpers import cuda_standin

    calls: list[str] = []
    owner = _standin_synchronize(monkeypatch, calls)
    original = owner.synchronize
    with cuda_standin.install():
        marks = SyncMarks().open()
        t0 = time.perf_counter()
        owner.synchronize()
        assert calls == ["synced"] and len(marks.since(t0)) == 1
        marks.close()
    assert owner.synchronize is original


def test_a_detector_window_closing_while_the_marks_are_open_leaves_them_hearing(monkeypatch):
    # The idle monitor's marks open at a step's start, inside a sync detector's window that
    # began at the previous step's end, and outlive it. Each once wrapped synchronize() on
    # its own: the window, put back at its end, took the marks' wrapper with it, and an
    # explicit synchronize() stopped being a sync stall for the rest of the epoch.
    import time

    from gpu_busy.idle.sync_marks import SyncMarks
    from gpu_busy.syncs import detect_syncs
    from tests.helpers import cuda_standin

    calls: list[str] = []
    owner = _standin_synchronize(monkeypatch, calls)
    original = owner.synchronize
    with cuda_standin.install():
        marks = SyncMarks()
        with detect_syncs(device_type="cuda", cuda_debug=False) as rec:
            marks.open()
            owner.synchronize()
        t0 = time.perf_counter()
        owner.synchronize()  # the window has closed; the marks are open
        assert len(marks.since(t0)) == 1 and [e.op for e in rec.events] == [
            "torch.cuda.synchronize()"
        ]
        marks.close()
    assert owner.synchronize is original and calls == ["synced", "synced"]


def test_a_clock_that_runs_dry_in_a_batch_layer_fails_the_fit_instead_of_ending_every_epoch(
    tmp_path,
):
    """Lightning's own throughput test mocks ``time.perf_counter`` with six values: the
    idle monitor's read layer then raised StopIteration, which ended every epoch at once,
    and a fit bounded by max_steps alone ran empty epochs for ever."""
    from unittest import mock

    import lightning.pytorch as pl
    import pytest
    from lightning.pytorch.demos.boring_classes import BoringModel

    from gpu_busy.callbacks import IdleTimeMonitor

    trainer = pl.Trainer(max_steps=5, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, default_root_dir=tmp_path,
                         callbacks=[IdleTimeMonitor()])  # fmt: skip
    clock = mock.patch("time.perf_counter", side_effect=[0.0] + [0.5 + i for i in range(1, 6)])
    with clock, pytest.raises(RuntimeError, match=r"perf_counter\(\) raised StopIteration"):
        trainer.fit(BoringModel())
