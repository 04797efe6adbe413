"""Mechanisms for measuring and improving the host/device relationship.

Nothing in this package imports Lightning: each piece works with plain PyTorch and is
tested alone; ``template.callbacks`` adapts them to the Trainer.

Example::

    from template.perf import assert_no_syncs, detect_syncs

    with detect_syncs(device_type="cpu") as rec:
        step(batch)
    print(*rec.events, sep="\\n")
"""

from template.perf.syncs import SyncError, SyncEvent, assert_no_syncs, detect_syncs

__all__ = ["SyncError", "SyncEvent", "assert_no_syncs", "detect_syncs"]
