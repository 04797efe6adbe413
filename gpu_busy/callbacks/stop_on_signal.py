"""StopOnSignal: on SIGTERM or SIGINT, save a checkpoint that resumes exactly, then stop.

The current step finishes, ``last.ckpt`` is written, and the run ends with one line and
exit code 128 + the signal; a second Ctrl+C stops at once. Under DDP the ranks agree at each
logging step in the fit's one gather (``StepClock``), or every ``every_n_steps`` in an
all-reduce of their own, in place of Lightning's per-step broadcast. In validation, test or
predict the run stops at the next batch's end without a save (a checkpoint taken there
would not resume consistently), and where no batch ends within ``wait`` seconds (a loader
that never yields) it stops without one. Details: docs/ARCHITECTURE.md, "Signals".

Example::

    trainer = Trainer(strategy="ddp", callbacks=[StopOnSignal(every_n_steps=50)])
    # stopped: SIGTERM at step 1234; saved runs/default/version_3/checkpoints/last.ckpt
    #          (resume with --ckpt_path last)
"""

from __future__ import annotations

import signal
from pathlib import Path

import lightning.pytorch as pl
import torch

from gpu_busy import batch_routing
from gpu_busy import lightning_compat as compat
from gpu_busy.callbacks.step_clock import StepClock
from gpu_busy.faults.stop_request import StopRequest, signal_name
from gpu_busy.faults.training_stopped import TrainingStopped, resume_hint
from gpu_busy.log import get_logger
from gpu_busy.syncs import allow_syncs

log = get_logger(__name__)


class StopOnSignal(compat.Callback):
    """Save ``last.ckpt`` and stop (all ranks at the same step) on SIGTERM or SIGINT.

    Args:
        every_n_steps: under DDP, steps between the ranks' agreement checks (an all-reduce
            each); None: at each logging step, in the gather the other callbacks' figures
            ride. One process checks every step regardless.
        wait: seconds after the signal within which a batch must end; past them the run
            stops where it is, without a save (``Options.stop_wait``).
    """

    def __init__(self, every_n_steps: int | None = None, wait: float = 20.0) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be 1 or more, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.wait = wait
        self.checks = 0  # DDP agreement checks run in this fit (for tests and curiosity)
        self.request = StopRequest()
        self._stopped = False  # this fit ended in a save-and-stop
        self._mine = 0  # this rank's signal at the last logging step, for the window
        self._undo_broadcast = None
        self._layer = batch_routing.Layer("stop-on-signal", position=-1)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.checks = 0
        self._install(trainer)
        # Lightning's per-step broadcast of its own flag is pure cost once its handler is
        # gone: turn it off entirely.
        self._undo_broadcast = compat.throttle_sigterm_broadcast(trainer, lambda: False)
        self._route(trainer.fit_loop)
        if self._in_window(trainer):
            StepClock.subscribe(trainer, self)

    def _install(self, trainer: pl.Trainer) -> None:
        # Lightning installs its SIGTERM handler just before the stage runs; this replaces it.
        self._stopped = False
        self.request = StopRequest(self.wait, lambda: self._overdue(trainer))
        if self.request.install():
            # Kept until teardown: after training, every rank still gathers its reports
            # (on_train_end, on_fit_end), and Lightning's own handler, which it would put
            # back first, starts a broadcast inside the handler, on the signalled rank only.
            handle = signal.getsignal(signal.SIGTERM)
            found = compat.keep_handlers_past_teardown(trainer, {signal.SIGTERM: handle})
            self.request.restore_to(found)

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit":
            self._route(trainer.fit_loop.epoch_loop.val_loop)
        elif not trainer.sanity_checking:
            self._install(trainer)

    def on_test_start(self, trainer, pl_module) -> None:
        self._install(trainer)

    def on_predict_start(self, trainer, pl_module) -> None:
        self._install(trainer)

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ):
        self._stop_unsaved_if_asked(trainer)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._stop_unsaved_if_asked(trainer)

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._stop_unsaved_if_asked(trainer)

    def _stop_unsaved_if_asked(self, trainer: pl.Trainer) -> None:
        # Each rank on its own signal, as Lightning's evaluation loop does: a launcher or a
        # scheduler signals every rank.
        if self.request.requested and not trainer.sanity_checking:
            stage = _STAGES.get(str(trainer.state.stage.value), str(trainer.state.stage.value))
            raise self._unsaved(trainer, f"in {stage}")

    def _overdue(self, trainer: pl.Trainer) -> TrainingStopped:
        return self._unsaved(trainer, f"no batch ended within {self.wait:g} s of it")

    def _unsaved(self, trainer: pl.Trainer, why: str) -> TrainingStopped:
        self._stopped = True
        saved = (
            "not saved (a checkpoint taken there would not resume consistently); the "
            f"checkpoints saved before are kept ({resume_hint()})"
            if trainer.state.fn == "fit"
            else "nothing to save"
        )
        return TrainingStopped(
            f"{self.request.name} at step {trainer.global_step}, {why}: {saved}",
            exit_code=128 + (self.request.signum or signal.SIGTERM),
            failure=False,
        )

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._route(trainer.fit_loop)  # reload_dataloaders_every_n_epochs: a new loader

    def _route(self, loop) -> None:
        """A layer next to the DataLoader: if its workers die after a stop was requested
        (signalled with the whole process group, without ``ignore_stop_signals``), the
        batch that cannot come is where the run saves and stops, instead of a traceback
        and no checkpoint. One process only: under DDP the ranks could be at different
        steps there, and a save waits for all of them."""
        trainer = loop.trainer
        if trainer.world_size > 1:
            return
        on_error = lambda _: self._workers_died(trainer)  # noqa: E731
        self._layer.route(loop, lambda items: batch_routing.OnReadError(items, on_error))

    def _workers_died(self, trainer: pl.Trainer) -> None:
        # The workers went with the signal; the last finished step is intact.
        if self.request.signum is not None:
            self._save_and_stop(trainer, self.request.signum)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._in_window(trainer):
            self._mine = self._signal_here(trainer)  # agreed in the window (log_window)
            return
        signum = self._agreed_signal(trainer)
        if signum:
            self._save_and_stop(trainer, signum)

    def _in_window(self, trainer: pl.Trainer) -> bool:
        """Under DDP, by default, the ranks agree in the fit's one logging window: one
        gather with the other callbacks' figures instead of an all-reduce of its own."""
        return trainer.world_size > 1 and self.every_n_steps is None

    def window_row(self) -> list[float]:
        return [float(self._mine)]

    def log_window(self, trainer: pl.Trainer, rows: list[list[float]]) -> None:
        self.checks += 1
        signum = int(max(row[0] for row in rows))
        if signum:
            self._save_and_stop(trainer, signum)

    def _signal_here(self, trainer: pl.Trainer) -> int:
        return self.request.signum or (int(signal.SIGTERM) if trainer.received_sigterm else 0)

    def _agreed_signal(self, trainer: pl.Trainer) -> int:
        """The signal every rank agrees to stop for, or 0 to go on."""
        mine = self._signal_here(trainer)
        if trainer.world_size == 1:
            return mine
        every = self.every_n_steps
        # Batches run in the whole fit: the same on every rank, and restored on resume.
        if trainer.fit_loop.epoch_loop.batch_progress.total.processed % every:
            return 0
        self.checks += 1
        with allow_syncs("StopOnSignal: the ranks agree on a stop every N steps"):
            flag = torch.tensor(mine, device=trainer.strategy.root_device)
            return int(trainer.strategy.reduce(flag, reduce_op="max").item())

    def _save_and_stop(self, trainer: pl.Trainer, signum: int) -> None:
        path = _last_checkpoint_path(trainer)
        name = signal_name(signum)
        log.info("%s received: saving %s at step %d", name, path, trainer.global_step)
        trainer.save_checkpoint(path, weights_only=False)  # all ranks: zero writes, all wait
        self._stopped = True
        raise TrainingStopped(
            f"{name} at step {trainer.global_step}; saved {path} ({resume_hint()})",
            exit_code=128 + signum,
            failure=False,
        )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_broadcast()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._layer.remove()
        if (clock := StepClock.of(trainer)) is not None:
            clock.remove(trainer)
        if self.request.requested and not self._stopped and trainer.state.fn == "fit":
            log.info(
                "%s after the last training step: the run had finished, its reports are "
                "written; nothing more to save",
                self.request.name,
                rank_zero_only=False,  # the signalled rank may be any
            )
        self.request.uninstall()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore_broadcast()
        self.request.uninstall()
        self._layer.remove()
        if trainer.state.fn == "fit" and not trainer.training:
            # Raised in the fit's validation: Lightning tears down the loop running then
            # (Trainer._teardown, _active_loop), the validation loop alone, and the training
            # loader's persistent workers would live on; workers that leave SIGTERM to this
            # process (faults.worker_signals) would then hold its exit forever.
            trainer.fit_loop.teardown()

    def _restore_broadcast(self) -> None:
        if self._undo_broadcast is not None:
            self._undo_broadcast()
            self._undo_broadcast = None


_STAGES = {"validate": "validation", "predict": "prediction"}  # RunningStage's values


def _last_checkpoint_path(trainer: pl.Trainer) -> Path:
    """``last.ckpt`` where the run's ModelCheckpoint writes, which ``--ckpt_path last`` finds."""
    for callback in trainer.checkpoint_callbacks:
        if getattr(callback, "dirpath", None):
            return Path(callback.dirpath) / "last.ckpt"
    return Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints" / "last.ckpt"
