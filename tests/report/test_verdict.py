"""The verdict: its rule on scripted reports, and on runs made to be bound each way."""

from __future__ import annotations

import json
import logging
import re
import time

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger

from gpu_busy.callbacks import IdleTimeMonitor, RunSummary, SyncPointDetector
from gpu_busy.idle.causes import thresholds
from gpu_busy.report.verdict import decide
from tests.conftest import ROOT
from tests.helpers.bound_runs import SlowBlobData, WideBlobClassifier
from tests.helpers.foreign_modules import BlobClassifier, BlobData
from tests.helpers.trainers import quiet_trainer


def gpu_report(**figures) -> dict:
    """An idle report as a GPU run writes it: 10 ms steps unless told otherwise."""
    mean = {
        "idle_ms": 0.0, "transfer_ms": 0.0, "device_ms": 10.0, "idle_data_wait_ms": 0.0,
        "idle_sync_stall_ms": 0.0, "idle_launch_bound_ms": 0.0, "idle_other_ms": 0.0,
    }  # fmt: skip
    mean.update(figures)
    mean["idle_ms"] = sum(mean[f"idle_{c}_ms"] for c in ("data_wait", "sync_stall",
                                                           "launch_bound", "other"))  # fmt: skip
    mean["transfer_host_ms"] = max(0.0, mean["transfer_ms"] - mean.get("copy_ms", 0.0))
    return {"clock": "cuda events", "world_size": 1, "mean": mean, "ranks": [mean]}


@pytest.mark.parametrize(
    ("figures", "cause", "lever"),
    [
        ({"idle_data_wait_ms": 3.0}, "data", "more DataLoader workers"),
        ({"idle_sync_stall_ms": 2.0, "idle_data_wait_ms": 1.0}, "syncs", "remove that read"),
        # launch-bound: graphs, one launch for the step's kernels
        ({"idle_launch_bound_ms": 1.0}, "launches", 'mode="reduce-overhead"'),
        # the host between steps: no compile mode shortens it
        ({"idle_other_ms": 1.0}, "host", "shorten the step, not the host's work between"),
        ({"transfer_ms": 2.0, "copy_ms": 2.0}, "copies", "StreamPrefetcher"),
        ({"transfer_ms": 2.0, "copy_ms": 0.1}, "transfer", "Dataset's workers"),  # the hooks
        # measured on a GPU machine: batch 256 -> 1024 took the transfer from 8% to 2%
        ({"transfer_ms": 2.0, "copy_ms": 0.1}, "transfer", "per batch, not per image"),
        # the GPU's own work (each cause below 5%): fusion, compile's default mode
        ({"idle_data_wait_ms": 0.4, "idle_other_ms": 0.4}, "device", "default mode (it fuses"),
    ],
)
def test_the_largest_cause_at_or_above_its_threshold_bounds_a_gpu_run(figures, cause, lever):
    """The cause that bounds the run, and the lever that fixes that bound: which compile
    mode for which bound among them."""
    verdict = decide(gpu_report(**figures))
    assert verdict.cause == cause, verdict.line
    assert verdict.line.startswith("verdict: bound by ") and "First try:" in verdict.line
    assert lever in verdict.line.split("First try:")[1], verdict.line
    if cause != "device":
        assert f"a problem above {100 * thresholds()[cause]:.0f}%" in verdict.line


@pytest.mark.parametrize(
    "figures",
    [{"idle_launch_bound_ms": 1.0}, {"idle_other_ms": 1.0}, {"transfer_ms": 2.0}, {}],
)
def test_where_the_verdict_advises_a_larger_batch_it_says_to_keep_the_steps(figures):
    """At the same epochs a larger batch takes fewer optimizer steps, which lost accuracy
    on a GPU machine (batch 2048: 0.84 against 1.00) whatever the learning rate."""
    line = decide(gpu_report(**figures)).line
    assert "a larger batch (fewer optimizer steps an epoch" in line, line
    assert "keep the steps, with max_steps or a larger max_epochs" in line
    assert line.count("a larger batch") == 1


def test_the_sync_verdict_names_the_costliest_site_and_its_cost():
    syncs = {
        "summary": {"steady_syncs_per_batch": 2.0},
        "sites": [{"op": "Tensor.item()", "location": "model.py:42",
                   "idle_after_ms_per_batch": 1.5}],
    }  # fmt: skip
    line = decide(gpu_report(idle_sync_stall_ms=1.6), syncs).line
    assert "host syncs" in line and "Tensor.item() at model.py:42" in line and "1.50 ms" in line


def test_a_cpu_run_never_blames_what_a_host_clock_cannot_see():
    report = gpu_report(idle_other_ms=0.1)
    report["clock"] = "host clock"
    for key in ("idle_sync_stall_ms", "idle_launch_bound_ms"):
        report["mean"][key] = None
    report["mean"]["transfer_ms"] = report["mean"]["transfer_host_ms"] = 2.0  # no copy on a CPU
    syncs = {"summary": {"steady_syncs_per_batch": 1.0}, "sites": []}
    verdict = decide(report, syncs)
    assert verdict.cause == "transfer" and "copies" not in verdict.line
    assert "1.00 syncs per steady batch found" in verdict.line
    assert decide(None).cause == "unknown" and "n/a" in decide({"mean": {}}).line


def test_one_slow_rank_is_named_from_the_loader_or_the_backward_wait():
    fast = {"rank": 0, "loader_wait_ms": 0.1, "host_backward_ms": 6.0}
    slow = {"rank": 1, "loader_wait_ms": 0.1, "host_backward_ms": 1.0}
    report = gpu_report()
    report.update(world_size=2, ranks=[fast, slow])
    verdict = decide(report)
    assert verdict.cause == "slow_rank" and "rank 1" in verdict.line and "backward" in verdict.line
    data = [dict(fast, host_backward_ms=1.0), dict(slow, loader_wait_ms=4.0)]
    report["ranks"] = data
    assert "rank 1" in decide(report).line and "DataLoader" in decide(report).line
    report["ranks"] = [dict(fast, host_backward_ms=1.5), slow]  # 0.5 ms: 5% < 10%
    assert decide(report).cause == "device"


# -- runs made to be bound, on the CPU -------------------------------------------------------


def fit_and_read(tmp_path, model, data, caplog, extra=()) -> tuple[dict, list[str]]:
    pl.seed_everything(0)
    trainer = quiet_trainer(
        max_epochs=2,
        logger=CSVLogger(tmp_path),
        limit_val_batches=0,
        callbacks=[SyncPointDetector(), IdleTimeMonitor(warmup_steps=3), RunSummary(), *extra],
    )
    with caplog.at_level(logging.INFO, logger="gpu_busy"):
        trainer.fit(model, data)
    run = json.loads((tmp_path / "lightning_logs" / "version_0" / "run.json").read_text())
    return run, [r.getMessage() for r in caplog.records]


def test_a_slow_dataloader_is_called_data_loading(tmp_path, caplog):
    run, lines = fit_and_read(tmp_path, BlobClassifier(num_classes=5), SlowBlobData(20), caplog)
    assert run["verdict"]["cause"] == "data", lines
    # The end-of-fit output starts with the verdict, then the reports, then the summary.
    starts = [next(i for i, x in enumerate(lines) if x.startswith(p))
              for p in ("verdict:", "sync points:", "idle time:", "fit done")]  # fmt: skip
    assert starts == sorted(starts)


def test_an_item_per_step_on_a_cpu_is_not_blamed_but_is_reported(tmp_path, caplog):
    model = WideBlobClassifier(features=64, item_every_step=True)
    run, lines = fit_and_read(tmp_path, model, BlobData(features=64, batch_size=128), caplog)
    (verdict,) = [x for x in lines if x.startswith("verdict:")]
    # A CPU has no queue to drain: the reads cost nothing here, and the line says so.
    assert run["verdict"]["cause"] != "syncs" and "syncs per steady batch found" in verdict


class SlowHooks(pl.Callback):
    """A callback that works 30 ms on the host after every step (per-step logging, say).
    A sleep: the cause holds however loaded the machine is (compute only grows there)."""

    def on_train_batch_end(self, *args) -> None:
        time.sleep(0.03)


@pytest.mark.slow  # about 5 s on 2 cores: a fit of many batches
def test_host_work_between_steps_is_called_the_hosts(tmp_path, caplog):
    run, lines = fit_and_read(tmp_path, BlobClassifier(num_classes=5), BlobData(batch_size=8),
                              caplog, extra=[SlowHooks()])  # fmt: skip
    assert run["verdict"]["cause"] == "host", [x for x in lines if x.startswith("verdict")]


class SlowTransferHook(BlobClassifier):
    """Host work in on_after_batch_transfer (an augmentation on the host, say)."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        if self.trainer.training:
            time.sleep(0.03)
        return batch


@pytest.mark.slow  # about 5 s on 2 cores: a fit of many batches
def test_the_verdict_quotes_a_row_of_the_table_and_advises_for_that_row(tmp_path, caplog):
    """A transfer hook's host work: named as the table names it, with its own advice, and
    the figure the verdict quotes is the one on that row."""
    run, lines = fit_and_read(tmp_path, SlowTransferHook(num_classes=5), BlobData(batch_size=8),
                              caplog)  # fmt: skip
    (verdict,) = [x for x in lines if x.startswith("verdict")]
    assert run["verdict"]["cause"] == "transfer", verdict
    assert "the host's work before the step" in verdict and "Dataset's workers" in verdict
    quoted = re.search(r"(\d+\.\d+) ms per batch", verdict).group(1)
    start = next(i for i, x in enumerate(lines) if x.startswith("idle time:"))
    table = lines[start : next(i for i, x in enumerate(lines) if x.startswith("idle report"))]
    (row,) = [x for x in table if x.strip().startswith("the host's work before the step")]
    assert f"{quoted} ms" in row and row.endswith("<< over"), row
    assert not any(x.endswith("<< over") for x in table if x is not row)


# One slow rank under 2-process CPU DDP, through the real entry point: with the other
# foreign-module DDP checks, tests/whole/test_foreign_code.py (one process pair, not two).


def test_a_fit_too_short_to_time_says_how_many_batches_it_needs(tmp_path, caplog):
    """Three batches an epoch, all warm-up: the table and the verdict say n/a once, and why."""
    pl.seed_everything(0)
    trainer = quiet_trainer(
        max_epochs=1,
        limit_train_batches=3,
        logger=CSVLogger(tmp_path),
        limit_val_batches=0,
        callbacks=[IdleTimeMonitor(warmup_steps=5), RunSummary()],
    )
    with caplog.at_level(logging.INFO, logger="gpu_busy"):
        trainer.fit(BlobClassifier(num_classes=5), BlobData())
    lines = [r.getMessage() for r in caplog.records]
    (verdict,) = [x for x in lines if x.startswith("verdict:")]
    assert verdict.startswith("verdict: n/a (no training batch was timed: the first 5 are")
    assert verdict.endswith("6 batches in one epoch are enough)")
    assert any(x.startswith("  n/a: no training batch was timed") for x in lines), lines
    assert not any("idle between steps" in x for x in lines)  # no table of n/a rows


def test_a_cause_added_to_the_table_reaches_the_report_verdict_compare_and_picture(
    tmp_path, monkeypatch, capsys
):
    """One row in gpu_busy.idle.causes, and every reader names it: nothing else to edit."""
    import matplotlib.axes

    from gpu_busy.idle import causes
    from gpu_busy.idle.stats import StepSeries
    from gpu_busy.report.compare import main as compare
    from gpu_busy.report.files import write_report
    from gpu_busy.report.idle import render_table
    from gpu_busy.report.picture import batch_breakdown

    paging = causes.Cause(
        "page_faults", "page faults", "paging", 0.05, True, "#000000",
        "page faults: the device waited {ms:.2f} ms per batch for host memory",
        "pin the batch's memory", "the part spent faulting pages in",
    )  # fmt: skip
    monkeypatch.setattr(causes, "TABLE", (*causes.TABLE, paging))
    report = gpu_report(idle_page_faults_ms=2.0)
    report["mean"]["idle_ms"] += 2.0
    report.update(steps=10, timed_steps=10, world_size=1, rank_max=report["mean"])
    assert any(line.startswith("  page faults") and "5% of a step" in line
               for line in render_table(report))  # fmt: skip
    verdict = decide(report)
    assert verdict.cause == "paging" and "First try: pin the batch's memory" in verdict.line
    assert causes.split_gap(3.0, {}, {"page_faults": True})["page_faults"] == 3.0
    runs = []
    for name in ("a", "b"):
        write_report(tmp_path / name, "idle", report)
        runs.append(str(tmp_path / name))
    compare([*runs, "--picture", ""])
    assert "  idle: page faults" in capsys.readouterr().out
    # The picture: its idle panel's layers are the table's rows, labels and colours.
    monkeypatch.setattr(StepSeries, "COLUMNS", (*StepSeries.COLUMNS, "idle_page_faults_ms"))
    layers = []
    bar = matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", lambda ax, *a, **kw: (
        layers.append((kw["label"], kw["color"])), bar(ax, *a, **kw))[1])  # fmt: skip
    row = [0.0] * len(StepSeries.COLUMNS)
    assert batch_breakdown({0: [row]}, tmp_path / "idle.png") is not None
    assert [(c.label, c.colour) for c in causes.TABLE] == [
        layer for layer in layers if layer[0] not in ("step", "transfer", "wait")
    ]


def test_the_guide_names_the_causes_as_the_table_does():
    from gpu_busy.idle import causes

    text = (ROOT / "docs" / "GUIDE.md").read_text()
    section = text[text.index("## Where the GPU waited") :]
    named = re.findall(r"^- \*\*([a-z -]+)\*\*:", section, flags=re.M)
    assert named == [c.label for c in causes.TABLE]
