"""A callback that leaves a daemon thread in torch's C++ code when the process exits.

pytorch/pytorch#38228: such a thread, ended by the interpreter's finalization, aborts the
process ("terminate called without an active exception"); the entry point's ranks must
end with their code all the same (gpu_busy/process_exit.py).
"""

from __future__ import annotations

import threading

import lightning.pytorch as pl

from tests.helpers.exit_threads import add_forever


class TorchThreadAtExit(pl.Callback):
    def on_fit_end(self, trainer, pl_module) -> None:  # late: the fit runs at its pace
        threading.Thread(target=add_forever, daemon=True).start()
