"""Callbacks the fault tests add from the command line (``--trainer.callbacks+=...``)."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import lightning.pytorch as pl


class RecordBatches(pl.Callback):
    """Appends ``<global step> <sha1 of the batch the step trained on>`` to ``path``.

    The batch is hashed after the device augmentation, so the line changes if either the
    data order or the random crops and flips differ.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        digest = hashlib.sha1(batch[0].detach().cpu().numpy().tobytes()).hexdigest()
        with self.path.open("a") as f:
            f.write(f"{trainer.global_step} {digest}\n")


class SaveAndStop(pl.Callback):
    """After training step ``step`` (1-based: ``global_step`` after it), save ``path`` and stop.

    ``at_epoch_end=True`` instead stops at the end of the epoch that step is in, leaving
    the saving to the run's own ModelCheckpoint.
    """

    def __init__(self, step: int, path: str = "", at_epoch_end: bool = False) -> None:
        self.step, self.path, self.at_epoch_end = step, path, at_epoch_end

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and not self.at_epoch_end:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.at_epoch_end and trainer.global_step >= self.step:
            trainer.should_stop = True


class SignalAt(pl.Callback):
    """Sends ``signal`` (a name: SIGTERM, SIGINT) ``times`` times to this process after step
    ``step``, on rank ``rank`` only; ``step=-1``: when the sanity check starts, before
    training; ``step=-2``: at the end of training, before the end-of-fit gathers."""

    def __init__(
        self, step: int, signal: str = "SIGTERM", rank: int = 0, times: int = 1,
        group: bool = False, in_validation: bool = False,
    ):  # fmt: skip
        self.step, self.signum, self.rank = step, getattr(signal_module, signal), rank
        self.times, self.group, self.in_validation = times, group, in_validation

    def _send(self) -> None:
        # group=True: to the whole process group, DataLoader workers included, as SLURM
        # and Kubernetes do (the test starts the run in a session of its own).
        for _ in range(self.times):
            if self.group:
                os.killpg(os.getpgid(0), self.signum)
            else:
                os.kill(os.getpid(), self.signum)

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        if self.step == -1 and trainer.global_rank == self.rank:
            os.kill(os.getpid(), self.signum)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.in_validation:
            return
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            self._send()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, *args):
        if not self.in_validation or trainer.sanity_checking:
            return
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            self.in_validation = False  # once
            self._send()

    def on_train_end(self, trainer, pl_module) -> None:
        if self.step == -2 and trainer.global_rank == self.rank:
            self._send()


signal_module = signal


class FailAt(pl.Callback):
    """Rank ``rank`` fails after step ``step``: ``raise`` a RuntimeError, or ``kill`` itself
    with SIGKILL (no Python code runs after that).

    Every rank writes its process id to ``pids/rank<R>``, and the failing rank the time of
    its failure to ``failed_at``, for the test to check how fast everything ended.
    """

    def __init__(self, step: int, rank: int = 1, how: str = "raise") -> None:
        self.step, self.rank, self.how = step, rank, how

    def on_train_start(self, trainer, pl_module) -> None:
        Path("pids").mkdir(exist_ok=True)
        Path("pids", f"rank{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            Path("failed_at").write_text(repr(time.time()))
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure at step {self.step}")


class RequeueSaveAt(pl.Callback):
    """After step ``step``, save as Lightning's SLURM requeue handler does on SIGUSR1
    (``_slurm_sigusr_handler_fn``: ``hpc_save_path(default_root_dir)``), then stop."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            connector = trainer._checkpoint_connector
            trainer.save_checkpoint(connector.hpc_save_path(trainer.default_root_dir))
            trainer.should_stop = True


class BreakRunDirAt(pl.Callback):
    """After step ``step``, delete the run's directory (``how="delete"``) or make it
    read-only (``how="readonly"``), as a cleanup script or a lost mount would."""

    def __init__(self, step: int, how: str = "delete") -> None:
        self.step, self.how = step, how

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step or not trainer.is_global_zero:
            return
        import shutil
        import stat

        folder = Path(trainer.log_dir)
        if self.how == "delete":
            shutil.rmtree(folder)
        else:
            for path in [folder, *folder.rglob("*")]:
                path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


class SlowCheckpointWrites(pl.Callback):
    """Every checkpoint write first leaves half its bytes in the staged file, touches
    ``<cwd>/writing``, and takes ``seconds`` longer: a slow disk, long enough for a test to
    signal or kill the run while a background write is in flight."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def setup(self, trainer, pl_module, stage) -> None:
        from gpu_busy.resume import checkpoint_file

        real = checkpoint_file._write_staged
        if getattr(real, "slowed", False):
            return

        def slow(path, stage_path, data):
            stage_path.parent.mkdir(parents=True, exist_ok=True)
            stage_path.write_bytes(bytes(data[: len(data) // 2]))
            Path("writing").write_text(str(path))
            time.sleep(self.seconds)
            real(path, stage_path, data)

        slow.slowed = True
        checkpoint_file._write_staged = slow


class FullDisk(pl.Callback):
    """Every checkpoint write finds its disk full (on rank zero, which writes)."""

    def setup(self, trainer, pl_module, stage) -> None:
        import errno

        from gpu_busy.resume import checkpoint_file

        def full(path, stage_path, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        checkpoint_file._write_staged = full


class BreakMeasurement(pl.Callback):
    """From step ``step`` on, on rank ``rank`` only, the measurement ``name`` raises inside
    (its figures' own method, as a bug in it would): ``idle``, ``throughput``, ``syncs``."""

    def __init__(self, name: str, rank: int = 1, step: int = 0) -> None:
        self.name, self.rank, self.step = name, rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        from gpu_busy.idle import IdleStats
        from gpu_busy.syncs.watched_steps import WatchedSteps
        from gpu_busy.throughput import ThroughputStats

        owner, attr = {"idle": (IdleStats, "add_step"), "throughput": (ThroughputStats, "add_step"),
                       "syncs": (WatchedSteps, "step_ends")}[self.name]  # fmt: skip

        def broken(*args, **kwargs):
            raise ValueError(f"a bug in the measurement on rank {self.rank}")

        setattr(owner, attr, broken)  # this process only: one rank's bug
