"""What an exact resume needs beyond Lightning's own checkpoint; no Lightning imports.

- ``ResumableSampler``: each epoch's order from ``seed + epoch``, restartable mid-epoch;
- ``capture_rng_state`` / ``restore_rng_state``: every generator's state as one tensor.

Example::

    sampler = ResumableSampler(dataset, num_replicas=world, rank=rank, seed=seed)
    sampler.resume_at(epoch, batches_trained, batch_size)
"""

from gpu_busy.resume.rng_state import capture_rng_state, restore_rng_state
from gpu_busy.resume.sampler import ResumableSampler

__all__ = ["ResumableSampler", "capture_rng_state", "restore_rng_state"]
