"""Keep the GPU busy and see where it waits: Lightning callbacks over plain mechanisms.

- ``gpu_busy.defaults()``: the whole default set, as ``Trainer`` arguments; ``gpu_busy.complete``
  adds it to callbacks and plugins of your own (``gpu_busy.callbacks.default_set``);
- ``python -m gpu_busy run train.py``: any Lightning script, unchanged, with the default set
  (``gpu_busy.launcher``);
- ``gpu_busy.callbacks``: the Lightning callbacks one by one (prefetch, sync detection, idle
  time, throughput and MFU, faults, exact resume, the run summary);
- ``prefetch``, ``syncs``, ``idle``, ``throughput``, ``faults``, ``resume``: the mechanisms
  under them, usable without Lightning;
- ``gpu_busy.is_logging_step(trainer)``: whether this training step's logs reach the
  loggers, for a module that reduces its metrics (a collective) only then.

Example::

    import gpu_busy
    trainer = pl.Trainer(max_epochs=10, **gpu_busy.defaults(monitor="val/acc"))
"""

import sys
from typing import Any

from gpu_busy import lightning_names

# pytorch_lightning and lightning.pytorch one package, before anything of ours imports either
# (gpu_busy.lightning_names: a finder that imports nothing itself)
lightning_names.make_one()
# A rank multiprocessing spawned (ddp_spawn) runs no entry point of ours; it imports
# gpu_busy as it unpickles the set, and from then on ends by the exit rule too.
if "multiprocessing.spawn" in sys.modules:  # else not a spawned child: nothing to import
    from gpu_busy.process_exit import end_spawned_rank_by_the_rule

    end_spawned_rank_by_the_rule()

__all__ = ["complete", "defaults", "is_logging_step"]


def __getattr__(name: str) -> Any:
    # Imported on first use: `import gpu_busy.prefetch` and the other mechanisms import no
    # Lightning, and the package itself must not either.
    if name == "is_logging_step":
        from gpu_busy.lightning_compat import is_logging_step

        return is_logging_step
    if name in __all__:
        from gpu_busy.callbacks import default_set

        return getattr(default_set, name)
    raise AttributeError(f"module 'gpu_busy' has no attribute {name!r}")
