"""Mechanisms for measuring and improving the host/device relationship.

Nothing in this package imports Lightning: each piece works with plain PyTorch and is
tested alone; ``gpu_busy.callbacks`` adapts them to the Trainer.

Example::

    from gpu_busy.syncs import assert_no_syncs, detect_syncs

    with detect_syncs(device_type="cpu") as rec:
        step(batch)
    print(*rec.events, sep="\\n")
"""

from gpu_busy.syncs.detector import SyncError, SyncEvent, assert_no_syncs, detect_syncs

__all__ = ["SyncError", "SyncEvent", "assert_no_syncs", "detect_syncs"]
