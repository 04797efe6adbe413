"""Keep the GPU busy and see where it waits: Lightning callbacks over plain mechanisms.

- ``gpu_busy.defaults()``: the whole default set, as ``Trainer`` arguments; ``gpu_busy.complete``
  adds it to callbacks and plugins of your own (``gpu_busy.callbacks.default_set``);
- ``python -m gpu_busy run train.py``: any Lightning script, unchanged, with the default set
  (``gpu_busy.launcher``);
- ``gpu_busy.callbacks``: the Lightning callbacks one by one (prefetch, sync detection, idle
  time, throughput and MFU, faults, exact resume, the run summary);
- ``prefetch``, ``syncs``, ``idle``, ``throughput``, ``faults``, ``resume``: the mechanisms
  under them, usable without Lightning.

Example::

    import gpu_busy
    trainer = pl.Trainer(max_epochs=10, **gpu_busy.defaults(monitor="val/acc"))
"""

from typing import Any

from gpu_busy import lightning_names

# pytorch_lightning and lightning.pytorch one package, before anything of ours imports either
# (gpu_busy.lightning_names: a finder that imports nothing itself)
lightning_names.make_one()

__all__ = ["complete", "defaults"]


def __getattr__(name: str) -> Any:
    # Imported on first use: `import gpu_busy.prefetch` and the other mechanisms import no
    # Lightning, and the package itself must not either.
    if name in __all__:
        from gpu_busy.callbacks import default_set

        return getattr(default_set, name)
    raise AttributeError(f"module 'gpu_busy' has no attribute {name!r}")
