"""What a rank runs at exit, importing no more than torch itself, and that only inside: a
process that spawns one imports this module to name its function.

pytorch/pytorch#38228: a thread in torch's C++ code when the interpreter finalizes aborts
the process; gpu_busy/process_exit.py is what keeps a rank's exit code.
"""

from __future__ import annotations

import atexit
import os
import threading


def add_forever() -> None:
    """Torch ops, each returning to Python through pybind11's GIL release, until exit."""
    import torch

    a = torch.randn(100)
    while True:
        a + a


def spawned_rank(folder: str, code: int, rule: bool) -> None:
    """A process multiprocessing spawned that joins a one-rank gloo group, leaves a torch
    thread running and ends with ``code``: through the exit rule, or Python's own exit."""
    import torch
    import torch.distributed as dist

    os.chdir(folder)
    dist.init_process_group("gloo", store=dist.FileStore("store", 1), rank=0, world_size=1)
    dist.all_reduce(torch.ones(2))
    threading.Thread(target=add_forever, daemon=True).start()
    atexit.register(lambda: open("atexit_ran", "w").close())
    if rule:  # importing gpu_busy installs the rule in a spawned child
        from gpu_busy.process_exit import end_spawned_rank_by_the_rule

        end_spawned_rank_by_the_rule()
    raise SystemExit(code)
