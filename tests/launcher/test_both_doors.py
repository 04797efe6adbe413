"""One run, two doors: ``python -m template.train`` (``make train``) and ``python -m gpu_busy
run`` end every run the same way (``gpu_busy.outcomes``), each door as a subprocess.

The model and data are ``tests.helpers.doors``; the launcher runs them from the plain
script ``scripts/ending_script.py``.
"""

from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import DEBUG, DEFAULT, HANG_S, ROOT

SCRIPT = Path(__file__).parent / "scripts" / "ending_script.py"
DOORS = ("entry point", "launcher")


def through(door: str, ending: str, cwd: Path, *, strict: bool = False, val_batches: int = 2,
            **env: str) -> subprocess.CompletedProcess:  # fmt: skip
    """The run ``ending`` asks for, through ``door``, in ``cwd``."""
    if door == "entry point":
        command = [
            sys.executable, "-m", "template.train", "fit", "--config", DEFAULT, "--config", DEBUG,
            "--model.class_path=tests.helpers.doors.EndingModel",
            f"--model.init_args.ending={ending}",
            "--data.class_path=tests.helpers.doors.EndingData",
            f"--data.init_args.ending={ending}", f"--data.init_args.val_batches={val_batches}",
            "--trainer.max_steps=16", "--trainer.limit_train_batches=1.0",
            f"--trainer.limit_val_batches={val_batches}", "--trainer.log_every_n_steps=1",
            *(["--gpu_busy.strict=true"] if strict else []),
        ]  # fmt: skip
    else:
        command = [sys.executable, "-m", "gpu_busy", "run", *(["--strict"] if strict else []),
                   str(SCRIPT), ending, f"--val-batches={val_batches}"]  # fmt: skip
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    full = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **env}
    for name in ("GPU_BUSY_STRICT_SYNCS", "GPU_BUSY_MODE", "LOCAL_RANK", "RANK"):
        if name not in env:
            full.pop(name, None)
    return subprocess.run(command, cwd=cwd, env=full, capture_output=True, text=True,
                          timeout=HANG_S, start_new_session=True)  # fmt: skip


def said(result: subprocess.CompletedProcess) -> list[str]:
    """The run's own lines: ``error:`` and ``stopped:``."""
    return [line for line in result.stderr.splitlines()
            if line.startswith(("error:", "stopped:"))]  # fmt: skip


def _ending(door: str, ending: str, tmp_path: Path, **kwargs) -> tuple[int, list[str], str]:
    cwd = tmp_path / door.replace(" ", "_")
    cwd.mkdir()
    result = through(door, ending, cwd, **kwargs)
    return result.returncode, said(result), result.stderr


ENDS = [  # the ending, its exit code, how its one line starts (None: no line of ours)
    ("success", 0, None),
    ("strict", 1, "error: strict sync check failed: "),
    ("exit3", 3, None),
    ("crash", 1, None),
    ("sigterm", 143, "stopped: SIGTERM at step 3; saved "),
    ("save_fails", 1, "error: "),
]


@pytest.mark.slow
@pytest.mark.parametrize(("ending", "code", "line"), ENDS)
def test_each_ending_is_the_same_line_and_exit_code_through_both_doors(
    tmp_path, ending, code, line
):
    ends = {door: _ending(door, ending, tmp_path, strict=ending == "strict") for door in DOORS}
    for door, (got, lines, stderr) in ends.items():
        assert got == code, f"{door}: exit {got}\n{stderr[-3000:]}"
        if line is None:
            assert lines == [], f"{door}: {lines}"
        else:
            assert len(lines) == 1 and lines[0].startswith(line), f"{door}: {stderr[-3000:]}"
        if ending == "crash":  # the user's traceback, from their frame
            assert "ValueError: the user's own error at step 2" in stderr
            assert "Traceback" in stderr and "tests/helpers/doors.py" in stderr
        else:
            assert "Traceback" not in stderr, f"{door}: {stderr[-3000:]}"
    if ending == "sigterm":  # each door names its own way back
        entry, launcher = (ends[door][1][0] for door in DOORS)
        assert entry.endswith("(resume with --ckpt_path last)"), entry
        assert launcher.endswith(f"(resume with python -m gpu_busy run --resume {SCRIPT} ...)")
        assert entry.split("; saved ")[0] == launcher.split("; saved ")[0]


@pytest.mark.slow
@pytest.mark.parametrize("door", DOORS)
def test_a_refused_setting_is_one_error_line_and_exit_2_through_both_doors(tmp_path, door):
    result = through(door, "success", tmp_path, GPU_BUSY_MODE="sideways")
    assert result.returncode == 2, result.stderr[-3000:]
    assert said(result) == ["error: GPU_BUSY_MODE='sideways': give max or min"]
    assert "Traceback" not in result.stderr


def _seconds_after_the_signal(door: str, ending: str, tmp_path: Path, **kwargs):
    at = tmp_path / f"{door.replace(' ', '_')}.signal_at"
    cwd = tmp_path / door.replace(" ", "_")
    cwd.mkdir()
    result = through(door, ending, cwd, ENDING_SIGNAL_AT=str(at), **kwargs)
    return time.time() - float(at.read_text()), result


@pytest.mark.slow
@pytest.mark.parametrize("door", DOORS)
def test_sigterm_in_a_long_validation_ends_the_run_within_seconds(tmp_path, door):
    """200 validation batches of 0.5 s: the run stops at the next one's end, as plain
    Lightning does, without a save (none would resume consistently there), and says so."""
    took, result = _seconds_after_the_signal(door, "sigterm_in_validation", tmp_path,
                                             val_batches=200)  # fmt: skip
    assert result.returncode == 143, result.stderr[-3000:]
    (line,) = said(result)
    assert line.startswith("stopped: SIGTERM at step 16, in validation: not saved"), line
    # the batch under way (0.5 s) and the end of the run (reports, exit); 100 s otherwise
    assert took < 15, f"{took:.1f} s after SIGTERM"


@pytest.mark.slow
@pytest.mark.parametrize("door", DOORS)
def test_sigterm_while_the_loader_never_yields_ends_the_run_within_the_stop_wait(tmp_path, door):
    """A batch that never comes: past ``stop_wait`` (2 s here) the stop interrupts the read.
    The last step finished before the read, so in one process the run saves there."""
    took, result = _seconds_after_the_signal(door, "loader_hangs", tmp_path,
                                             GPU_BUSY_STOP_WAIT="2")  # fmt: skip
    assert result.returncode == 143, result.stderr[-3000:]
    (line,) = said(result)
    assert line.startswith("stopped: SIGTERM at step 2; saved "), line
    assert 2 <= took < 15, f"{took:.1f} s after SIGTERM"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["lightning", "torchrun"])
def test_sigterm_on_a_two_rank_fit_under_the_launcher_is_one_stopped_line(tmp_path, launcher):
    """Every rank gets SIGTERM after step 2 (as a scheduler signals them all); the ranks
    agree, save once and stop; rank zero alone says so and exits 143, the others 0.
    torchrun's own exit code is torchrun's: a rank's 143 is a failure to it."""
    run = ["-m", "gpu_busy", "run", str(SCRIPT), "sigterm", "--strategy=ddp", "--devices=2"]
    if launcher == "torchrun":
        run = ["-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(_free_port()), *run]  # fmt: skip
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([sys.executable, *run], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=HANG_S)  # fmt: skip
    lines = said(result)
    out = result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("stopped: SIGTERM at step "), out
    assert "--resume" in lines[0] and "Traceback (most recent call last)" not in lines[0]
    if launcher == "lightning":
        assert result.returncode == 143, result.stderr[-3000:]
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
    else:  # torchrun reports the rank that ended non-zero, and which code it had
        assert result.returncode != 0 and "exitcode  : 143" in result.stderr, result.stderr[-3000:]


def _losses(run: Path) -> dict[int, str]:
    """``train/loss`` by step, from a CSVLogger's metrics.csv."""
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    return {int(r["step"]): r["train/loss"] for r in rows if r.get("train/loss")}


@pytest.mark.slow
def test_resume_continues_an_unchanged_script_where_sigterm_stopped_it(tmp_path):
    """A shuffled DataLoader with no position of its own: after a SIGTERM at step 3,
    ``--resume`` gives the script's fit the last.ckpt the set wrote, starts the epoch again
    from the generator states it began with and reads past the 3 batches trained; every
    loss logged from there on is the uninterrupted run's."""
    script = [str(SCRIPT), "--plain-loader"]

    def launched(cwd: Path, *args: str) -> subprocess.CompletedProcess:
        cwd.mkdir(exist_ok=True)
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        return subprocess.run([sys.executable, "-m", "gpu_busy", "run", *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=HANG_S)  # fmt: skip

    whole = launched(tmp_path / "whole", *script, "success")
    assert whole.returncode == 0, whole.stderr[-3000:]
    nothing = launched(tmp_path / "split", "--resume", *script, "sigterm")
    assert nothing.returncode == 143, nothing.stderr[-3000:]
    assert "--resume: no last.ckpt under runs/ending; training from the start" in nothing.stderr
    resumed = launched(tmp_path / "split", "--resume", *script, "sigterm")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    last = Path("runs/ending/version_0/checkpoints/last.ckpt")
    assert f"--resume: resuming from {last}" in resumed.stderr, resumed.stderr[-3000:]
    before = _losses(tmp_path / "whole" / "runs" / "ending" / "version_0")
    after = _losses(tmp_path / "split" / "runs" / "ending" / "version_1")
    assert min(after) == 3 and max(after) == max(before) == 15, (sorted(after), sorted(before))
    assert after == {step: before[step] for step in after}
    assert "resuming 3 batches into epoch 0" in resumed.stderr
