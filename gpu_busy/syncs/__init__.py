"""Finding host-device syncs: which lines make the host wait for the GPU.

Nothing here imports Lightning; ``gpu_busy.callbacks.SyncPointDetector`` runs it over a
sample of training steps.

Example::

    from gpu_busy.syncs import assert_no_syncs, detect_syncs

    with detect_syncs(device_type="cpu") as rec:
        step(batch)
    print(*rec.events, sep="\\n")
"""

from gpu_busy.syncs.attribution import SyncError, SyncEvent, allow_syncs, not_allowed
from gpu_busy.syncs.checks import assert_no_syncs
from gpu_busy.syncs.detector import detect_syncs

__all__ = [
    "SyncError", "SyncEvent", "allow_syncs", "assert_no_syncs", "detect_syncs", "not_allowed",
]  # fmt: skip
