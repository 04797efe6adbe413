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
    # On a CPU the syncs gate is on by default (allowed +0), and decides
    assert main([after, before, "--picture", ""]) == 1
    *_, gate, last = capsys.readouterr().out.strip().splitlines()
    assert gate.startswith("syncs gate FAILED: syncs per steady batch 0.00 -> ")
    assert last == "worse: B failed the syncs gate"
    assert main([before, after, "--picture", ""]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "better: B has fewer syncs per steady batch, and failed no gate"
    )


def write_syncs(folder, per_batch: float | None) -> None:
    write_report(folder, "syncs", {"summary": {"steady_syncs_per_batch": per_batch}})


def test_where_the_syncs_changed_the_syncs_gate_decides_unless_told_otherwise(tmp_path, capsys):
    """68.6 -> 182 samples/s with 2.67 more syncs per steady batch: worse by default (the
    syncs changed), better where --sync-threshold allows them."""
    a, b = write_run(tmp_path / "a", 68.6), write_run(tmp_path / "b", 182.0)
    write_syncs(tmp_path / "a", 0.0)
    write_syncs(tmp_path / "b", 2.67)
    assert main([a, b, "--picture", ""]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "throughput gate passed: samples/s +165.3%" in out[-4]
    assert out[-1] == "worse: B failed the syncs gate"
    assert main([a, b, "--picture", "", "--sync-threshold", "3"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "better: B has more throughput beyond both runs' spread, and failed no gate"
    )


def write_steady(folder, device: str, windows: list[float], syncs: float | None) -> str:
    """A run's throughput.json (steady samples/s, the mean of its windows) and syncs.json."""
    write_report(folder, "throughput", {"device": device, "samples_per_s": sum(windows) /
                 len(windows), "window_samples_per_s": windows})  # fmt: skip
    write_syncs(folder, syncs)
    return str(folder)


def test_two_runs_of_the_same_code_are_within_noise_not_worse(tmp_path, capsys):
    """-28.5%, with each run's logging windows spread across the other's: noise."""
    a = write_steady(tmp_path / "a", "NVIDIA H100", [900.0, 1500.0, 1300.0], 0.0)
    b = write_steady(tmp_path / "b", "NVIDIA H100", [700.0, 1000.0, 1000.0], 0.0)
    assert main([a, b, "--picture", ""]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "within noise" in out[-4] and out[-1] == "ok: B failed no gate, throughput within noise"
    # beyond both runs' spread, the same drop fails
    c = write_steady(tmp_path / "c", "NVIDIA H100", [600.0, 650.0, 700.0], 0.0)
    assert main([a, c, "--picture", ""]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "worse: B failed the throughput gate"


def test_on_a_cpu_the_syncs_decide_and_nine_fewer_are_better(tmp_path, capsys):
    a = write_steady(tmp_path / "a", "cpu", [900.0, 700.0, 800.0], 9.0)
    b = write_steady(tmp_path / "b", "cpu", [500.0, 550.0, 520.0], 0.0)  # a loaded machine
    assert main([a, b, "--picture", ""]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-4].startswith("throughput gate off on a CPU")
    assert out[-1] == "better: B has fewer syncs per steady batch, and failed no gate"


def test_runs_no_gate_could_compare_are_a_check_that_checked_nothing_and_fail(tmp_path, capsys):
    # On a CPU the syncs decide; fits too short to watch a steady batch give them nothing.
    a = write_steady(tmp_path / "a", "cpu", [900.0, 700.0], None)
    b = write_steady(tmp_path / "b", "cpu", [500.0, 550.0], None)
    assert main([a, b, "--picture", ""]) == 1
    *_, gate, last = capsys.readouterr().out.strip().splitlines()
    assert gate == ("syncs gate n/a: syncs per steady batch n/a (A watched no steady batch; "
                    "B watched no steady batch)")  # fmt: skip
    assert last.startswith("checked nothing: no gate had figures of both runs to compare")
    assert "first_steps=" in last
    (tmp_path / "a" / "syncs.json").unlink()
    assert main([a, b, "--picture", ""]) == 1
    assert "(A's syncs.json is missing; B watched no steady batch)" in capsys.readouterr().out
    # one gate with figures is a check: a GPU pair whose syncs are unchanged passes
    c = write_steady(tmp_path / "c", "NVIDIA H100", [900.0, 1000.0], None)
    d = write_steady(tmp_path / "d", "NVIDIA H100", [950.0, 980.0], None)
    assert main([c, d, "--picture", ""]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("ok: B failed no gate")


def write_run(folder, samples_per_s: float) -> str:
    write_report(folder, "run", {"fit_samples_per_s": samples_per_s})
    return str(folder)


@pytest.mark.parametrize(("b_rate", "status"), [(96.0, 0), (94.0, 1)])
def test_a_throughput_drop_beyond_the_threshold_fails(tmp_path, capsys, b_rate, status):
    a, b = write_run(tmp_path / "a", 100.0), write_run(tmp_path / "b", b_rate)
    assert main([a, b]) == status
    out = capsys.readouterr().out
    failed = "throughput gate FAILED: samples/s -6.0% (no logging windows to judge the noise by)"
    assert (failed in out) == bool(status)
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
    assert "throughput gate FAILED: samples/s -6.0%" in capsys.readouterr().out


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
