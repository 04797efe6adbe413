"""StopOnRankFailure: when one DDP rank fails, every rank exits within bounded time.

A ``gpu_busy.faults.peer_watch.PeerWatch`` on every rank: a rank that raises records why
and prints its own traceback; the others see it within ``poll_interval`` and one of them
prints a single line naming the rank; all exit with code 1. A rank killed silently is
noticed at once when Lightning's launcher started it, else after ``peer_timeout`` of
silence. Details: docs/ARCHITECTURE.md, "A failed rank".

Example::

    trainer = Trainer(strategy="ddp", devices=4, callbacks=[StopOnRankFailure(peer_timeout=60)])
    # error: rank 2 failed (RuntimeError: CUDA error: an illegal memory access was
    #        encountered); stopped the other ranks. Its traceback is above
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from gpu_busy import lightning_compat as compat
from gpu_busy.callbacks.ranks import group_store, leave_at_once
from gpu_busy.faults.peer_watch import PeerWatch, failure_line, lost_a_peer
from gpu_busy.faults.training_stopped import TrainingStopped
from gpu_busy.log import get_logger

log = get_logger(__name__)


def _nothing() -> None:
    """Nothing to undo (a module function, not a lambda: the callback pickles for ddp_spawn)."""


class StopOnRankFailure(compat.Callback):
    """Under DDP, turn one rank's failure into a prompt, explained exit of every rank.

    Args:
        peer_timeout: seconds of heartbeat silence after which a rank counts as dead.
        poll_interval: seconds between heartbeats and checks of the failure record.
    """

    def __init__(self, peer_timeout: float = 30.0, poll_interval: float = 0.5) -> None:
        if peer_timeout <= poll_interval or poll_interval <= 0:
            raise ValueError(
                f"need 0 < poll_interval < peer_timeout, got {poll_interval} and {peer_timeout}"
            )
        self.peer_timeout, self.poll_interval = peer_timeout, poll_interval
        self.watch: PeerWatch | None = None
        self._store = None
        self._undo_observer: Callable[[], None] = _nothing
        self._trainer: pl.Trainer | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size < 2 or not dist.is_initialized() or self.watch is not None:
            return
        self._trainer = trainer
        rank = trainer.global_rank
        environment = trainer.strategy.cluster_environment
        host, port = environment.main_address, environment.main_port
        prefix = trainer.strategy.broadcast(f"gpu_busy/peer_watch/{uuid.uuid4().hex}/", src=0)
        error = None
        try:
            self._store = group_store(trainer, prefix, self.peer_timeout)
        except Exception as e:  # the group's store is not a TCPStore there: train on, unwatched
            error = e
        # All ranks watch, or none: a rank without a heartbeat would be declared dead.
        ready = torch.tensor(int(self._store is not None), device=trainer.strategy.root_device)
        if not trainer.strategy.reduce(ready, reduce_op="min").item():
            log.warning("StopOnRankFailure is off: the process group's store at %s:%s is out "
                        "of reach (%s)", host, port, error, rank_zero_only=False)  # fmt: skip
            return
        self.watch = PeerWatch(
            self._store, rank, trainer.world_size, self._stop_for,
            poll_interval=self.poll_interval, peer_timeout=self.peer_timeout,
            exit_codes=lambda: compat.child_exit_codes(trainer),
        ).start()  # fmt: skip
        # The watch sees a dead child rank first and says which; Lightning's own observer
        # would kill this process without a word if it looked in the meantime.
        self._undo_observer = compat.defer_child_observer()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        watch = self.watch
        if watch is None:
            return
        if isinstance(exception, TrainingStopped | KeyboardInterrupt):
            watch.finish()  # every rank stops together: not a failure
            return
        peer = watch.wait_for_peer_failure(0)
        if peer is None and lost_a_peer(exception):
            # The collective failed because some rank went away: wait for the watch to say
            # which, rather than blame this rank.
            peer = watch.wait_for_peer_failure(self.peer_timeout + 2 * self.poll_interval)
        if peer is not None:
            self._stop_for(*peer)
        message = " ".join(str(exception).split())[:300]
        watch.report_failure(f"{type(exception).__name__}: {message}")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.watch is not None:
            self.watch.finish()
            self.watch = None
        self._undo_observer()
        self._undo_observer = _nothing

    def _stop_for(self, rank: int, reason: str) -> None:
        """Another rank failed: say so once, and leave (the main thread may be stuck in a
        collective that will never complete, so this exits from whichever thread sees it)."""
        me = self.watch.rank if self.watch else 0
        speaker = 1 if rank == 0 else 0
        if me == speaker:
            print(failure_line(rank, reason), file=sys.stderr, flush=True)
        # Whatever this process started ends with it: a rank stopped (SIGSTOP) or stuck in
        # a collective would otherwise outlive the run.
        leave_at_once(self._trainer)
