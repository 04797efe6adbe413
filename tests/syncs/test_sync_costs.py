"""What each sync cost: the host's wait in it and the GPU idle after it (scripted timelines
on the host clock, the detector's wiring on the CPU, the real thing on a GPU)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from gpu_busy.callbacks import SyncPointDetector
from gpu_busy.syncs import detect_syncs
from gpu_busy.syncs.attribution import SyncEvent
from gpu_busy.syncs.costs import SyncTimeline
from gpu_busy.syncs.sites import SyncSiteTable
from tests.helpers.bound_runs import WideBlobClassifier
from tests.helpers.foreign_modules import BlobData
from tests.helpers.trainers import quiet_trainer

# -- scripted timelines (seconds on one host clock) ------------------------------------------


def test_a_sync_costs_its_wait_and_the_idle_until_the_next_launch_less_own_time():
    t = SyncTimeline()
    t.began(0, at=10.000)
    t.returned(at=10.004)  # 4 ms waiting for the queue to drain
    t.own(10.003, 10.0045)  # the handler's tail: only what falls after the return counts
    t.own(10.006, 10.0065)  # the next op's handler, before it launches
    t.launch(at=10.008)
    t.launch(at=10.050)  # later launches change nothing
    cost = t.take()[0]
    assert cost.host_ms == pytest.approx(4.0)
    assert cost.idle_after_ms == pytest.approx(4.0 - 0.5 - 0.5)


def test_back_to_back_syncs_split_the_idle_and_an_unended_idle_is_not_measured():
    t = SyncTimeline()
    t.began(0, at=1.000)
    t.returned(at=1.001)
    t.began(1, at=1.003)  # a second read: the idle from here on is its own
    t.returned(at=1.0031)
    t.close()  # the window ends before any launch
    costs = t.take()
    assert costs[0].idle_after_ms == pytest.approx(2.0)
    assert costs[1].host_ms == pytest.approx(0.1) and costs[1].idle_after_ms is None
    assert t.idle_since is None  # closed: no idle left open


def test_launches_and_own_time_outside_an_idle_change_nothing():
    t = SyncTimeline()
    t.launch(at=1.0)
    t.own(1.0, 2.0)
    assert t.take() == {}


def test_sites_rank_by_the_idle_they_cost_not_by_how_often_they_sync():
    def event(line: int, idle: float | None) -> SyncEvent:
        return SyncEvent("Tensor.item()", "train.py", line, host_ms=0.1, idle_after_ms=idle)

    table = SyncSiteTable()
    for step in range(4):  # line 10: every step, cheap; line 20: once, costly
        table.add_all([event(10, 0.01)], step=step, logging=False)
    table.add_all([event(20, 8.0), event(30, None)], step=3, logging=False)
    ranked = table.ranked(watched=4)
    assert [s.lineno for s in ranked] == [20, 10, 30]
    assert ranked[0].idle_per_batch(4) == pytest.approx(2.0)
    assert ranked[2].idle_per_batch(4) is None  # never measured: not a zero
    text = "\n".join(table.render(watched=4, step_ms=20.0))
    assert "GPU idle after it 2.000 ms/batch (10.0% of a step)" in text
    assert "GPU idle after it n/a; host waited in it 0.025 ms/batch" in text
    # Merged over ranks, the sums add.
    merged = SyncSiteTable()
    merged.merge(table.rows())
    merged.merge(table.rows())
    assert merged.ranked(watched=8)[0].idle_per_batch(8) == pytest.approx(2.0)
    # Without costs (the CPU simulation) nothing is kept, and the order is by count.
    plain = SyncSiteTable(costs=False)
    plain.add_all([event(20, 8.0)], step=0, logging=False)
    assert plain.sites[("train.py", 20, "Tensor.item()", "forward", None)].idle_timed == 0


# -- the detector's wiring, on the host clock -------------------------------------------------


def test_the_detector_times_each_sync_and_the_gap_to_the_next_op_that_launches():
    x = torch.randn(64, 64)
    with detect_syncs(device_type="cpu") as rec:
        y = x @ x
        y.sum().item()
        time.sleep(0.03)
        y.view(-1)  # a view launches nothing: the gap goes on
        time.sleep(0.01)
        y = y * 2  # launches
        bool(y.sum() > 0)
        torch.cpu.synchronize()  # the next sync ends the bool's gap; nothing after it
    item, cond, sync = rec.take()
    assert 40.0 <= item.idle_after_ms < 80.0, item
    assert item.host_ms is not None and item.host_ms < 20.0
    assert cond.idle_after_ms is not None and cond.idle_after_ms < 20.0
    assert sync.op == "torch.cpu.synchronize()" and sync.host_ms is not None
    assert sync.idle_after_ms is None  # the window closed first: not measured


def test_the_callback_reports_costs_as_na_on_a_cpu(tmp_path):
    detector = SyncPointDetector(first_steps=4)
    trainer = quiet_trainer(
        max_epochs=1,
        limit_train_batches=6,
        limit_val_batches=0,
        logger=CSVLogger(tmp_path),
        callbacks=[detector],
    )
    trainer.fit(WideBlobClassifier(width=32, item_every_step=True), BlobData())
    saved = json.loads((tmp_path / "lightning_logs" / "version_0" / "syncs.json").read_text())
    assert saved["summary"]["sync_idle_ms_per_batch"] is None
    (site,) = [s for s in saved["sites"] if "losses.append" in s["code"]]
    assert site["count"] == saved["summary"]["watched_batches"] >= 4 and site["steps"]
    assert site["idle_after_ms_per_batch"] is None and site["idle_timed"] == 0


# -- on a GPU: a known .item() behind a known amount of queued work -----------------------------


@pytest.mark.gpu
def test_an_item_behind_queued_work_costs_that_work_and_the_host_gap_after_it():
    x = torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)  # a spin kernel; its length measured below
    end.record()
    end.synchronize()
    queued_ms = start.elapsed_time(end)
    with detect_syncs(device_type="cuda") as rec:
        y = x @ x
        torch.cuda._sleep(50_000_000)
        y.sum().item()
        time.sleep(0.02)  # the host does something else: the GPU has nothing to run
        y = y @ x
        torch.cuda.synchronize()
    item = next(e for e in rec.take() if e.op == "Tensor.item()")
    assert item.host_ms == pytest.approx(queued_ms, rel=0.2, abs=2.0)
    assert item.idle_after_ms == pytest.approx(20.0, abs=3.0)


def test_the_cost_line_gives_the_total_with_its_threshold_or_says_na():
    from gpu_busy.report.syncs import _cost_line

    gpu = {"sync_idle_ms_per_batch": 1.5, "sync_idle_share": 0.1, "sync_host_ms_per_batch": 3.0}
    assert _cost_line(gpu) == (
        "  cost of the syncs: 1.500 ms of GPU idle after them per batch (10.0% of a step; "
        "removing every one gains at most that; worth it above 5%), host waited 3.000 ms in them"
    )
    assert "n/a" in _cost_line({"sync_idle_ms_per_batch": None})


def test_nested_detectors_each_time_an_explicit_synchronize():
    # The callback's detector and a user's detect_syncs inside it both record the call; each
    # must time it, and neither may carry it over to time the next sync it sees.
    x = torch.randn(8, 8)
    with detect_syncs(device_type="cpu") as outer, detect_syncs(device_type="cpu") as inner:
        torch.cpu.synchronize()
        time.sleep(0.01)
        x.sum().item()
    for rec in (outer, inner):
        sync, item = rec.take()
        assert sync.host_ms is not None and sync.idle_after_ms is not None, sync
        assert sync.idle_after_ms >= 9.0  # its own gap, ended by the .item()
        assert item.op == "Tensor.item()" and item.host_ms is not None
