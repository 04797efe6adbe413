"""python -m gpu_busy.report.compare: two runs side by side, and an exit status CI can gate on."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger

from gpu_busy.callbacks import IdleTimeMonitor, RunSummary, SyncPointDetector
from gpu_busy.report.compare import main
from gpu_busy.report.files import SCHEMA_VERSION, write_report
from tests.helpers.bound_runs import SyncFreeBlobClassifier
from tests.helpers.foreign_modules import BlobClassifier, BlobData
from tests.helpers.trainers import quiet_trainer


def fit(folder, model) -> str:
    pl.seed_everything(0)
    trainer = quiet_trainer(
        max_epochs=2,
        logger=CSVLogger(folder),
        limit_val_batches=0,
        callbacks=[SyncPointDetector(first_steps=6), IdleTimeMonitor(warmup_steps=2), RunSummary()],
    )
    trainer.fit(model, BlobData())
    return trainer.log_dir


def test_two_real_runs_before_and_after_a_sync_fix(tmp_path, capsys):
    # A: prog_bar=True values and torchmetrics called per step (reads each step). B: the
    # same model logging on-device tensors.
    before = fit(tmp_path / "a", BlobClassifier(num_classes=5))
    after = fit(tmp_path / "b", SyncFreeBlobClassifier(num_classes=5))
    # Throughput on a shared CPU is noise here: gate on the syncs alone.
    assert main([before, after, "--threshold", "0.99", "--sync-threshold", "0"]) == 0
    out = capsys.readouterr().out
    (row,) = [x for x in out.splitlines() if x.startswith("syncs per steady batch")]
    a_syncs, b_syncs = row.split()[4:6]
    assert float(a_syncs) >= 2 and b_syncs == "0.00", row
    assert "A top sync sites: " in out and "bincount" in out and "B top sync sites: none" in out
    assert "A verdict: bound by" in out and list((tmp_path / "b").rglob("compare.png"))
    # The other way round, B brings the syncs back: exit 1 with the syncs gate on, saying
    # which gate; with it off (the default), said but not failed.
    assert main([after, before, "--threshold", "0.99", "--picture", "", "--sync-threshold",
                 "0.5"]) == 1  # fmt: skip
    *_, gate, last = capsys.readouterr().out.strip().splitlines()
    assert gate == f"syncs gate FAILED: syncs per steady batch 0.00 -> {a_syncs} (allowed +0.5)"
    assert last == "worse: B failed the syncs gate"
    assert main([after, before, "--threshold", "0.99", "--picture", ""]) == 0
    *_, gate, last = capsys.readouterr().out.strip().splitlines()
    assert gate.startswith("syncs gate off: syncs per steady batch 0.00 -> ")
    assert last == "ok: B failed no gate"


def write_syncs(folder, per_batch: float) -> None:
    write_report(folder, "syncs", {"summary": {"steady_syncs_per_batch": per_batch}})


def test_a_faster_run_with_more_syncs_passes_unless_the_syncs_gate_is_on(tmp_path, capsys):
    """Throughput first: 68.6 -> 182 samples/s is better, whatever else moved."""
    a, b = write_run(tmp_path / "a", 68.6), write_run(tmp_path / "b", 182.0)
    write_syncs(tmp_path / "a", 0.0)
    write_syncs(tmp_path / "b", 2.67)
    assert main([a, b, "--picture", ""]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "throughput gate passed: samples/s +165.3% (allowed -5%)" in out
    assert out[-1] == "ok: B failed no gate"
    assert main([a, b, "--picture", "", "--sync-threshold", "1"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "worse: B failed the syncs gate"


def write_run(folder, samples_per_s: float) -> str:
    write_report(folder, "run", {"fit_samples_per_s": samples_per_s})
    return str(folder)


@pytest.mark.parametrize(("b_rate", "status"), [(96.0, 0), (94.0, 1)])
def test_a_throughput_drop_beyond_the_threshold_fails(tmp_path, capsys, b_rate, status):
    a, b = write_run(tmp_path / "a", 100.0), write_run(tmp_path / "b", b_rate)
    assert main([a, b]) == status
    out = capsys.readouterr().out
    assert ("throughput gate FAILED: samples/s -6.0% (allowed -5%)" in out) == bool(status)
    assert out.strip().splitlines()[-1] == (
        "worse: B failed the throughput gate" if status else "ok: B failed no gate"
    )
    assert "n/a" in out  # no idle or sync report: their rows say so, no picture


def test_an_older_run_json_is_read_under_the_keys_renamed_since(tmp_path, capsys):
    # Before version 4 run.json named its whole-fit rate "samples_per_s", as
    # throughput.json names the steady one.
    a = tmp_path / "a"
    a.mkdir()
    (a / "run.json").write_text(json.dumps({"schema_version": 3, "samples_per_s": 100.0}))
    b = write_run(tmp_path / "b", 94.0)
    assert main([str(a), b, "--picture", ""]) == 1
    assert "throughput gate FAILED: samples/s -6.0% (allowed -5%)" in capsys.readouterr().out


def test_a_folder_without_reports_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"holds no run\.json"):
        main([str(tmp_path), str(tmp_path)])
    with pytest.raises(SystemExit, match="not a directory"):
        main([str(tmp_path / "missing"), str(tmp_path)])


def test_a_run_file_of_a_newer_layout_is_refused_in_one_line(tmp_path):
    a = write_run(tmp_path / "a", 100.0)
    b = write_run(tmp_path / "b", 100.0)
    path = tmp_path / "b" / "run.json"
    path.write_text(json.dumps({"schema_version": SCHEMA_VERSION + 1, "samples_per_s": 1.0}))
    with pytest.raises(SystemExit) as err:
        main([a, b, "--picture", ""])
    assert str(err.value) == (
        f"error: {path} has schema_version {SCHEMA_VERSION + 1}, this gpu_busy reads up to "
        f"{SCHEMA_VERSION}: compare with the gpu_busy that wrote it"
    )
