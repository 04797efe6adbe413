"""EveryRankAttached: under DDP, every rank runs the same gpu_busy callbacks, or the fit ends
at set-up with one line.

The callbacks gather their figures over ranks: a rank started without them (one node's
launcher without ``python -m gpu_busy run``) would leave the others waiting in a gather
while it waits in its own collectives. Each rank writes the names of its gpu_busy
callbacks into the process group's store, which is no collective, and reads the others'
within ``timeout`` seconds; a rank missing or different ends the run before any gather.

Example::

    trainer = Trainer(strategy="ddp", devices=2, callbacks=[EveryRankAttached(), ...])
    # error: rank 1 of 2 has no gpu_busy callbacks (started without python -m gpu_busy
    #        run?): every rank needs the same set, or none does; stopped at set-up
"""

from __future__ import annotations

import itertools
import os
import sys
import time

import lightning.pytorch as pl
import torch.distributed as dist

from gpu_busy import lightning_compat as compat
from gpu_busy.callbacks.ranks import group_store, leave_at_once

# seconds a rank waits for the others' names: the ranks leave Lightning's "pre_setup"
# barrier together, so only a rank without the callbacks leaves its key unset this long
# Set-ups in this process: every rank runs the same sequence of fits, so the n-th set-up
# of each rank meets the others' n-th under one key, whatever else the store holds.
_setups = itertools.count()


class EveryRankAttached(compat.Callback):
    """Check at set-up that every DDP rank has the same gpu_busy callbacks.

    Args:
        timeout: seconds to wait for the other ranks' names (the default set's:
            ``Options.rank_wait``).
    """

    def __init__(self, timeout: float = 60.0) -> None:
        self.timeout = timeout

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size < 2 or not dist.is_initialized():
            return
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's store lives on
        prefix = f"gpu_busy/every_rank/{restart}/{next(_setups)}/"
        try:
            store = group_store(trainer, prefix, self.timeout)
        except Exception:  # no TCPStore there: nothing to check against, and no gather hangs
            return  # on it alone (StopOnRankFailure says so for the store)
        rank, world = trainer.global_rank, trainer.world_size
        mine = ",".join(sorted(type(c).__name__ for c in trainer.callbacks
                               if type(c).__module__.startswith("gpu_busy.")))  # fmt: skip
        store.set(str(rank), mine)
        deadline = time.monotonic() + self.timeout
        while not store.check([str(r) for r in range(world)]):
            if time.monotonic() > deadline:
                missing = [r for r in range(world) if not store.check([str(r)])]
                present = [r for r in range(world) if r not in missing]
                _stop(trainer, rank == present[0], _missing_line(missing, world))
            time.sleep(0.05)
        for r in range(world):
            theirs = store.get(str(r)).decode()
            if theirs != mine:
                line = (f"rank {r} runs other gpu_busy callbacks than rank {rank} ("
                        f"{theirs or 'none'} there, {mine} here): give every rank the same set; "
                        "stopped at set-up")  # fmt: skip
                _stop(trainer, rank == 0, line)


def _stop(trainer: pl.Trainer, speak: bool, line: str) -> None:
    """Say ``line`` where ``speak`` (one rank does) and leave at once: a rank stopped here is
    outside every collective, and the others wait in theirs."""
    if speak:
        print(f"error: {line}", file=sys.stderr, flush=True)
    leave_at_once(trainer)


def _missing_line(missing: list[int], world: int) -> str:
    ranks = ", ".join(map(str, missing))
    return (
        f"rank{'s' if len(missing) > 1 else ''} {ranks} of {world} "
        f"{'have' if len(missing) > 1 else 'has'} no gpu_busy callbacks (started without "
        "python -m gpu_busy run?): every rank needs the same set, or none does; stopped at "
        "set-up"
    )
