"""DataLoader workers that leave SIGTERM and SIGINT to the main process.

Clusters stop a job by signalling its whole process group (SLURM's ``scancel``,
Kubernetes), DataLoader workers included. A worker that dies of it first makes the main
process raise "DataLoader worker (pid ...) exited unexpectedly" before it can save. The
main process decides what a stop means (``StopOnSignal`` saves, then stops); a worker
should carry on until the main process ends it. ``ignore_stop_signals(fn)`` is a
``worker_init_fn`` that sets both signals to ignored in the worker, then calls ``fn`` (your
own ``worker_init_fn``, if any). It pickles, so it works with every start method.

Example::

    DataLoader(dataset, num_workers=4, worker_init_fn=ignore_stop_signals(seed_worker))
"""

from __future__ import annotations

import signal
from collections.abc import Callable

from gpu_busy.faults.stop_request import SIGNALS


class ignore_stop_signals:
    def __init__(self, then: Callable[[int], None] | None = None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        for signum in SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        if self.then is not None:
            self.then(worker_id)
