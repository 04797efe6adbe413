"""Run Lightning's DDP SIGTERM check every N steps instead of at every step.

Under DDP, Lightning broadcasts rank zero's "received SIGTERM" flag at the start of every
training step and reads it back with ``.item()``: a collective plus a host-device sync
per step. Its purpose is that all ranks stop together when the job is preempted. Done at
every ``every_n_steps``-th batch (the same batches on every rank), it keeps that purpose
and costs a sync per N steps; the ranks then stop at most N steps after the signal.

By default N is ``log_every_n_steps``, and the check lands right after a logging step,
whose metrics Lightning has just read back: little is queued on the GPU by then, so the
check adds little wait of its own.

Example::

    trainer = Trainer(strategy="ddp", callbacks=[SigtermCheckInterval(every_n_steps=50)])
"""

from __future__ import annotations

import lightning.pytorch as pl

from template import lightning_compat as compat


class SigtermCheckInterval(pl.Callback):
    """Let Lightning's per-step SIGTERM broadcast run only every ``every_n_steps`` batches.

    Args:
        every_n_steps: batches between checks; None uses the trainer's log_every_n_steps.
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be 1 or more, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.checks = 0  # broadcasts run in this fit (for tests and curiosity)
        self._undo = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        every = self.every_n_steps or max(1, trainer.log_every_n_steps)
        progress = trainer.fit_loop.epoch_loop.batch_progress
        self.checks = 0

        def due() -> bool:
            # batches read so far in the whole run: equal on every rank, restored on resume
            if progress.total.ready % every == 0:
                self.checks += 1
                return True
            return False

        self._undo = compat.throttle_sigterm_broadcast(trainer, due)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None
