"""Preemption and crashed ranks: the run saves what it can, says why, and never hangs."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gpu_busy.faults.peer_watch import PeerWatch, describe_exit
from gpu_busy.faults.stop_request import StopRequest
from gpu_busy.faults.training_stopped import TrainingStopped
from tests.conftest import DEBUG, DEFAULT, HANG_S, run_entry_point

# -- the mechanisms, alone -------------------------------------------------------------


def test_a_signal_becomes_a_request_and_a_second_ctrl_c_stops_at_once():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    stop = StopRequest()
    assert stop.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.name == "SIGTERM"
        os.kill(os.getpid(), signal.SIGTERM)  # later signals do not change the first
        assert stop.signum == signal.SIGTERM
        with pytest.raises(TrainingStopped, match="Ctrl\\+C twice") as stopped:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)  # the handler runs at the next bytecode
        assert stopped.value.exit_code == 130 and not stopped.value.failure
    finally:
        stop.uninstall()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def _watches(n: int, **kw) -> tuple[dist.HashStore, list[PeerWatch], list]:
    store, seen = dist.HashStore(), []
    watches = [
        PeerWatch(store, r, n, lambda rank, why, me=r: seen.append((me, rank, why)), **kw)
        for r in range(n)
    ]
    return store, watches, seen


def _until(condition, seconds: float = 5.0) -> float:
    start = time.monotonic()
    while not condition() and time.monotonic() - start < seconds:
        time.sleep(0.01)
    return time.monotonic() - start


def test_a_rank_that_raises_is_seen_by_the_others_within_the_poll_interval():
    _, watches, seen = _watches(3, poll_interval=0.05, peer_timeout=5)
    for w in watches:
        w.start()
    watches[1].report_failure("RuntimeError: boom")
    waited = _until(lambda: len(seen) == 2)
    assert sorted(seen) == [(0, 1, "RuntimeError: boom"), (2, 1, "RuntimeError: boom")]
    # Bounds tell the mechanisms apart (a report vs the 5 s peer timeout) with room for a
    # loaded machine's scheduling; none is a speed claim.
    assert waited < 2.5
    # The first failure recorded stays the one reported.
    watches[2].report_failure("RuntimeError: Connection closed by peer")
    assert watches[2].failure() == (1, "RuntimeError: boom")


def test_rank_zero_declares_a_silent_rank_dead_after_the_peer_timeout():
    _, watches, seen = _watches(2, poll_interval=0.05, peer_timeout=0.5)
    # Timed from before start(): the watch's silence clock starts inside it, so a bound
    # measured from after start() returns can read a few microseconds short of 0.5 s.
    started = time.monotonic()
    watches[0].start()  # rank 1 never beats: it was killed before it could
    _until(lambda: seen, seconds=5)
    waited = time.monotonic() - started
    # The silence is in whole seconds: 0 s on an idle machine, more on a loaded one.
    ((observer, peer, why),) = seen
    assert (observer, peer) == (0, 1) and re.fullmatch(
        r"stopped responding for \d+ s \(killed, or frozen\)", why
    ), seen
    assert 0.5 <= waited < 4


def test_a_child_that_exited_is_named_at_once_with_its_signal():
    _, watches, seen = _watches(2, poll_interval=0.05, peer_timeout=30)
    watches[0].exit_codes = lambda: {1: -signal.SIGKILL}
    watches[1].start()  # still beating: the exit code alone says it is gone
    watches[0].start()
    assert _until(lambda: seen) < 5  # the exit code, not the 30 s peer timeout
    assert seen == [(0, 1, "was killed by SIGKILL")]
    assert describe_exit(3) == "exited with code 3"


def test_a_clean_finish_is_not_a_failure_and_rank_zero_waits_for_the_others():
    _, watches, seen = _watches(2, poll_interval=0.05, peer_timeout=5)
    for w in watches:
        w.start()
    late = threading.Timer(0.3, watches[1].finish)
    late.start()
    started = time.monotonic()
    watches[0].finish()
    assert 0.25 < time.monotonic() - started < 4.5  # waited for rank 1, not the timeout
    time.sleep(0.2)
    assert seen == []


def test_a_rank_that_loses_the_store_concludes_rank_zero_is_gone():
    class GoneStore(dist.HashStore):
        def add(self, key, value):
            raise dist.DistNetworkError("Connection reset by peer")

    seen = []
    watch = PeerWatch(GoneStore(), 1, 2, lambda *a: seen.append(a), poll_interval=0.05)
    watch.start()
    assert _until(lambda: seen) < 1.0
    assert seen == [(0, "is gone (its store stopped answering)")]


# -- the real entry point ---------------------------------------------------------------


def _stderr_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith(("error:", "stopped:"))]


def _saved_and_stopped(result, root: Path, step: int) -> Path:
    """The run "split" stopped on SIGTERM with one line, its last.ckpt at ``step``."""
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-3000:]
    last = root / "runs" / "split" / "version_0" / "checkpoints" / "last.ckpt"
    assert _stderr_lines(result) == [
        f"stopped: SIGTERM at step {step}; saved {last.relative_to(root)} "
        "(resume with --ckpt_path last)"
    ]
    assert "Traceback" not in result.stderr
    assert torch.load(last, weights_only=True, map_location="cpu")["global_step"] == step
    return last


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_that_resumes_exactly(in_tmp, capsys):
    from tests.resume.test_resume import RUN, assert_same_training_state, fit, steps

    fit(in_tmp, "whole")
    # Written as a GPU run writes them: in the background, and slowly, so the epoch-end
    # saves (after step 4) are still in flight when the signal comes.
    result = run_entry_point(
        [*RUN, "--trainer.logger.init_args.name=split",
         "--trainer.plugins=gpu_busy.checkpoint_io.BackgroundCheckpointIO",
         "--trainer.plugins.init_args.background=true",
         "--trainer.callbacks+=tests.helpers.faults_probe.SlowCheckpointWrites",
         "--trainer.callbacks.init_args.seconds=1",
         "--trainer.callbacks+=tests.helpers.faults_probe.RecordBatches",
         f"--trainer.callbacks.init_args.path={in_tmp / 'split.batches'}",
         "--trainer.callbacks+=tests.helpers.faults_probe.SignalAt",
         "--trainer.callbacks.init_args.step=5"],
        cwd=in_tmp,
    )  # fmt: skip
    # The step the signal arrived in finished; the next check (after step 6) saved and
    # stopped, once the writes in flight and its own had landed.
    assert (in_tmp / "writing").exists(), "no write was slowed"
    last = _saved_and_stopped(result, in_tmp, step=6)

    capsys.readouterr()
    fit(in_tmp, "split", "--ckpt_path=last")
    # Where each part of the run is: the resumed run says it, and its summary counts its own.
    err = capsys.readouterr().err
    assert f"resuming from {last.relative_to(in_tmp)} into a new version directory" in err
    assert "the steps before it stay in runs/split/version_0" in err
    (summary,) = [line for line in err.splitlines() if "fit done in" in line]
    assert "resumed at step 6" in summary, summary
    # the stopped part wrote its reports, and the resumed run's summary says where
    assert "runs/split/version_0 (the run that saved last.ckpt)" in summary, summary
    assert (in_tmp / "runs" / "split" / "version_0" / "run.json").exists()
    assert steps(in_tmp / "split.batches") == steps(in_tmp / "whole.batches")
    resumed = in_tmp / "runs" / "split" / "version_1" / "checkpoints" / "last.ckpt"
    whole = in_tmp / "runs" / "whole" / "version_0" / "checkpoints" / "last.ckpt"
    assert_same_training_state(whole, resumed)


@pytest.mark.slow
def test_sigterm_to_the_process_group_with_workers_saves_and_resumes_exactly(in_tmp, capsys):
    """As SLURM and Kubernetes stop a job: every process of the group, the template's two
    persistent DataLoader workers too, gets SIGTERM. The workers leave it to the main
    process, which saves and stops (the signal after step 2 is acted on after step 3); the
    resumed run ends where one that never stopped ends."""
    from tests.resume.test_resume import RUN, assert_same_training_state, fit, steps

    fit(in_tmp, "whole", "--data.num_workers=2")
    result = run_entry_point(
        [*RUN, "--data.num_workers=2", "--trainer.logger.init_args.name=split",
         "--trainer.callbacks+=tests.helpers.faults_probe.RecordBatches",
         f"--trainer.callbacks.init_args.path={in_tmp / 'split.batches'}",
         "--trainer.callbacks+=tests.helpers.faults_probe.SignalAt",
         "--trainer.callbacks.init_args.step=2", "--trainer.callbacks.init_args.group=true"],
        cwd=in_tmp, new_session=True,
    )  # fmt: skip
    _saved_and_stopped(result, in_tmp, step=3)
    capsys.readouterr()
    fit(in_tmp, "split", "--data.num_workers=2", "--ckpt_path=last")
    assert steps(in_tmp / "split.batches") == steps(in_tmp / "whole.batches")
    resumed = in_tmp / "runs" / "split" / "version_1" / "checkpoints" / "last.ckpt"
    whole = in_tmp / "runs" / "whole" / "version_0" / "checkpoints" / "last.ckpt"
    assert_same_training_state(whole, resumed)


@pytest.mark.slow
def test_sigterm_to_the_group_in_validation_stops_there_and_the_workers_end(tmp_path):
    """In the fit's validation (after step 4, the end of epoch 0) the run stops at the next
    validation batch, unsaved, and says so. Lightning tears down only the validation loop
    after an error there; the training loader's persistent workers, which ignore SIGTERM,
    are ended too, or the process would wait for them at exit for ever."""
    result = run_entry_point(
        ["fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.max_epochs=2",
         "--data.num_workers=2", "--trainer.callbacks+=tests.helpers.faults_probe.SignalAt",
         "--trainer.callbacks.init_args.step=4", "--trainer.callbacks.init_args.group=true",
         "--trainer.callbacks.init_args.in_validation=true"],
        cwd=tmp_path, new_session=True, timeout=300,  # a hang, not a slow machine
    )  # fmt: skip
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-3000:]
    (line,) = _stderr_lines(result)
    assert line.startswith("stopped: SIGTERM at step 4, in validation: not saved"), line
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
def test_workers_that_die_with_the_group_do_not_stop_the_save(tmp_path):
    """A DataLoader of your own, with plain workers: the signal kills them, and the batch
    that can no longer come is where the run saves (the last finished step) and stops."""
    result = run_entry_point(
        ["fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.max_epochs=2",
         "--trainer.limit_train_batches=16",
         "--model.class_path=tests.helpers.foreign_modules.BlobClassifier",
         "--data.class_path=tests.helpers.foreign_modules.BlobData", "--data.batch_size=8",
         "--data.num_workers=2",
         "--trainer.callbacks+=tests.helpers.faults_probe.SignalAt",
         "--trainer.callbacks.init_args.step=2", "--trainer.callbacks.init_args.group=true"],
        cwd=tmp_path, new_session=True,
    )  # fmt: skip
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-3000:]
    (line,) = _stderr_lines(result)
    # Step 3 runs too if its batch was already queued when the workers died.
    saved = int(line.split(" at step ")[1].split(";")[0])
    assert saved in (2, 3) and line.endswith("(resume with --ckpt_path last)"), line
    assert "Traceback" not in result.stderr
    last = tmp_path / "runs" / "debug" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True, map_location="cpu")["global_step"] == saved


@pytest.mark.slow
def test_ctrl_c_saves_and_exits_130(tmp_path):
    result = run_entry_point(
        ["fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.max_epochs=2",
         "--trainer.callbacks+=tests.helpers.faults_probe.SignalAt",
         "--trainer.callbacks.init_args.step=2", "--trainer.callbacks.init_args.signal=SIGINT"],
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 128 + signal.SIGINT, result.stderr[-3000:]
    (line,) = _stderr_lines(result)
    assert line.startswith("stopped: SIGINT at step 3; saved ")
    assert "KeyboardInterrupt" not in result.stderr


@pytest.mark.slow
def test_sigterm_before_training_is_one_line_and_exit_143(tmp_path):
    # Before on_train_start the signal is still Lightning's, which would exit 0.
    result = run_entry_point(
        ["fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.num_sanity_val_steps=2",
         "--trainer.callbacks+=tests.helpers.faults_probe.SignalAt",
         "--trainer.callbacks.init_args.step=-1"],
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-3000:]
    assert _stderr_lines(result) == ["stopped: SIGTERM before the first batch; nothing to save"]


DDP = ["fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.accelerator=cpu",
       "--trainer.devices=2", "--trainer.max_epochs=2",
       "--trainer.log_every_n_steps=4"]  # fmt: skip


def _all_exited(tmp_path: Path) -> bool:
    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    pids = [int(p.read_text()) for p in (tmp_path / "pids").iterdir()]
    assert len(pids) == 2
    return _until(lambda: not any(alive(p) for p in pids), seconds=10) < 10


@pytest.mark.slow
def test_ddp_sigterm_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    result = run_entry_point(
        [*DDP, "--trainer.callbacks+=tests.helpers.faults_probe.SignalAt",
         "--trainer.callbacks.init_args.step=1", "--trainer.callbacks.init_args.rank=1",
         "--trainer.callbacks+=tests.helpers.faults_probe.FailAt",  # here only to record the pids
         "--trainer.callbacks.init_args.step=-1"],
        cwd=tmp_path, timeout=HANG_S,
    )  # fmt: skip
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-3000:]
    # Rank 1 alone got the signal after step 1; the ranks agreed at the next check (step 4).
    last = Path("runs", "debug", "version_0", "checkpoints", "last.ckpt")
    assert _stderr_lines(result) == [
        f"stopped: SIGTERM at step 4; saved {last} (resume with --ckpt_path last)"
    ]
    saved = torch.load(tmp_path / last, weights_only=True, map_location="cpu")
    assert saved["global_step"] == 4
    assert saved["callbacks"]["CheckpointRngState"]["per_rank"].shape[0] == 2
    assert saved["ImageDataModule"] == {"epoch": 1, "batches_trained": 0, "batch_size": 32}
    assert _all_exited(tmp_path)
    # The reports of the 4 steps it ran, gathered over both ranks as at a fit's end
    run = tmp_path / "runs" / "debug" / "version_0"
    for name in ("run", "syncs", "idle", "throughput"):
        assert (run / f"{name}.json").exists(), (name, sorted(p.name for p in run.iterdir()))
    assert json.loads((run / "idle.json").read_text())["world_size"] == 2
    assert json.loads((run / "run.json").read_text())["steps"] == 4


@pytest.mark.slow
def test_ddp_sigterm_on_one_rank_at_the_end_of_fit_ends_both_without_a_hang(tmp_path):
    # After the last step every rank still gathers its reports (on_train_end, on_fit_end).
    # Lightning's own SIGTERM handler broadcasts from inside the handler: on one rank only,
    # that collective pairs with another rank's gather. The template's handler, kept until
    # teardown, only takes note.
    result = run_entry_point(
        [*DDP, "--trainer.max_epochs=1", "--trainer.callbacks+=tests.helpers.faults_probe.SignalAt",
         "--trainer.callbacks.init_args.step=-2", "--trainer.callbacks.init_args.rank=1",
         "--trainer.callbacks+=tests.helpers.faults_probe.FailAt",  # here only to record the pids
         "--trainer.callbacks.init_args.step=-1"],
        cwd=tmp_path, timeout=HANG_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "idle time:" in result.stderr + result.stdout  # the end-of-fit reports came out
    assert _all_exited(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rank", "how", "says"),
    [
        (1, "raise", "error: rank 1 failed (RuntimeError: injected failure at step 2)"),
        (0, "raise", "error: rank 0 failed (RuntimeError: injected failure at step 2)"),
        (1, "kill", "error: rank 1 was killed by SIGKILL"),
    ],
)
def test_a_failed_rank_ends_every_rank_promptly_naming_it(tmp_path, rank, how, says):
    result = run_entry_point(
        [*DDP, "--trainer.callbacks+=tests.helpers.faults_probe.FailAt",
         "--trainer.callbacks.init_args.step=2", f"--trainer.callbacks.init_args.rank={rank}",
         f"--trainer.callbacks.init_args.how={how}"],
        cwd=tmp_path, timeout=HANG_S,
    )  # fmt: skip
    ended = time.time()
    assert result.returncode == 1, result.stderr[-3000:]
    (line,) = [line for line in _stderr_lines(result) if line.startswith("error: rank")]
    assert line.startswith(says), line
    assert "Connection closed by peer" not in result.stderr
    # Documented bound: a raise is seen within the poll interval (0.5 s), and so is a
    # child the launcher started being killed; the rest is process exit (slow on a loaded
    # machine; without the watch the ranks would wait for the collective's 30 min timeout).
    assert ended - float((tmp_path / "failed_at").read_text()) < 120
    assert _all_exited(tmp_path)


def test_the_peer_watch_opens_no_port_of_its_own(monkeypatch):
    """It joins the process group's store as a client, under a prefix of its own: a second
    listener would be a door into the job (stop it, write its error line) on every interface."""
    from types import SimpleNamespace

    from gpu_busy.callbacks import StopOnRankFailure

    group_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    opened, real_store = [], dist.TCPStore

    def spy(*args, **kwargs):
        opened.append(kwargs.get("is_master", len(args) > 3 and args[3]))
        return real_store(*args, **kwargs)

    monkeypatch.setattr(dist, "TCPStore", spy)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    environment = SimpleNamespace(main_address="127.0.0.1", main_port=group_store.port)
    strategy = SimpleNamespace(
        cluster_environment=environment,
        root_device=torch.device("cpu"),
        broadcast=lambda obj, src=0: obj,
        reduce=lambda t, reduce_op: t,
    )
    trainer = SimpleNamespace(world_size=2, global_rank=1, strategy=strategy)
    callback = StopOnRankFailure(peer_timeout=5, poll_interval=0.05)
    keys_before = group_store.num_keys()
    callback.setup(trainer, None, "fit")
    try:
        assert opened == [False]  # one client, no listener
        deadline = time.monotonic() + 5
        while group_store.num_keys() == keys_before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group_store.num_keys() > keys_before  # the heartbeat lands in the group's store
        assert not callback._store.check(["failed"])
    finally:
        callback.watch.finish(wait=0)


# -- a second Ctrl+C while a checkpoint is written -------------------------------------------


def test_a_second_ctrl_c_during_a_save_lets_the_file_finish_then_stops(tmp_path, monkeypatch):
    from gpu_busy.resume import checkpoint_file

    target = tmp_path / "last.ckpt"
    target.write_bytes(b"the previous save")
    real_fsync = os.fsync

    def interrupted_fsync(fd):  # both Ctrl+C arrive while the staged file is synced
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        real_fsync(fd)

    stop = StopRequest()
    assert stop.install()
    try:
        monkeypatch.setattr(checkpoint_file.os, "fsync", interrupted_fsync)
        with pytest.raises(TrainingStopped, match="once the checkpoint being written was saved"):
            checkpoint_file.write_atomically(target, b"the new save")
    finally:
        stop.uninstall()
    assert target.read_bytes() == b"the new save"
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"], "a partial file was left"


def test_anything_that_ends_a_save_midway_takes_the_partial_file_with_it(tmp_path, monkeypatch):
    from gpu_busy.resume import checkpoint_file

    target = tmp_path / "last.ckpt"
    target.write_bytes(b"the previous save")

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_file.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint_file.write_atomically(target, b"the new save")
    assert target.read_bytes() == b"the previous save"
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"], "a partial file was left"


@pytest.mark.slow
def test_a_master_port_in_use_is_one_line_and_leaves_no_process(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_entry_point(
            [*DDP, "--trainer.callbacks+=tests.helpers.faults_probe.FailAt",  # records the pids
             "--trainer.callbacks.init_args.step=-1"],
            cwd=tmp_path, timeout=HANG_S,
            env={"MASTER_PORT": str(port), "MASTER_ADDR": "127.0.0.1"},
        )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert _stderr_lines(result) == [
        f"error: MASTER_PORT={port} cannot be used on this machine (Address already in use); "
        "unset it (Lightning then picks a free port) or choose a free one"
    ]
    assert not (tmp_path / "pids").exists(), "a rank was started"


def test_a_rank_that_stops_the_run_ends_the_ranks_it_started_even_frozen(monkeypatch):
    """Rank zero exits at once when another rank failed; a rank it started that is frozen
    (SIGSTOP) or stuck must not outlive it."""
    import subprocess
    import sys
    import types

    from gpu_busy.callbacks import StopOnRankFailure

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    os.kill(child.pid, signal.SIGSTOP)
    launcher = types.SimpleNamespace(procs=[child])
    trainer = types.SimpleNamespace(local_rank=0, strategy=types.SimpleNamespace(launcher=launcher))
    callback = StopOnRankFailure()
    callback._trainer = trainer

    def leave(code):
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", leave)
    try:
        with pytest.raises(SystemExit):
            callback._stop_for(1, "is silent (no heartbeat for 30 s)")
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()


@pytest.mark.slow
def test_a_run_directory_deleted_mid_run_costs_its_old_logs_not_the_run(tmp_path):
    result = run_entry_point(
        ["fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.max_epochs=2",
         "--trainer.callbacks+=tests.helpers.faults_probe.BreakRunDirAt",
         "--trainer.callbacks.init_args.step=2"],
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.count("the run directory") == 1 and "was gone: made again" in result.stderr
    run = tmp_path / "runs" / "debug" / "version_0"
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert saved["global_step"] == 8 and (run / "metrics.csv").is_file()


def test_a_guarded_logger_pickles_as_ddp_spawn_sends_it_to_every_rank(tmp_path):
    import pickle

    from lightning.pytorch.loggers import CSVLogger

    from gpu_busy.faults.log_writes import GuardedSave, guard_log_writes

    logger = CSVLogger(tmp_path)
    guard_log_writes([logger])
    guarded = logger.save
    guard_log_writes([logger])  # a second call keeps the one guard
    assert logger.save is guarded
    copy = pickle.loads(pickle.dumps(logger))
    assert isinstance(copy.save, GuardedSave) and copy.save.logger is copy
    copy.log_metrics({"x": 1.0}, step=0)
    copy.save()
    assert (Path(copy.log_dir) / "metrics.csv").read_text().startswith("step,x")


def test_a_log_write_that_keeps_failing_is_one_warning_and_training_goes_on(tmp_path, caplog):
    # A read-only run directory (what this test's root user cannot make: a stand-in logger).
    import logging

    from gpu_busy.faults.log_writes import guard_log_writes

    calls = []

    class ReadOnlyLogger:
        log_dir = str(tmp_path)

        def save(self):
            calls.append(1)
            raise PermissionError(13, "Permission denied")

    logger = ReadOnlyLogger()
    guard_log_writes([logger])
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert logger.save() is None
    assert len(calls) == 3 and caplog.text.count("cannot write the") == 1
    assert "Permission denied" in caplog.text and "training goes on" in caplog.text
