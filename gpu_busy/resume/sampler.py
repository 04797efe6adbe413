"""A training sampler whose order depends only on (seed, epoch), and that can start mid-epoch.

PyTorch's ``RandomSampler`` draws each epoch's order from the global random generator, so
the order after a resume depends on everything else that drew from it since the start.
Here the permutation of epoch ``e`` is ``randperm`` under ``seed + e`` (``DistributedSampler``'s
rule, sharded the same way under DDP), and ``resume_at(epoch, batches)`` makes that epoch
start after the batches a checkpointed run had already trained on.

Being a ``DistributedSampler``, Lightning leaves it in place under DDP instead of wrapping
the loader in a sampler of its own.

Example::

    sampler = ResumableSampler(dataset, num_replicas=1, rank=0, seed=0)
    sampler.resume_at(epoch=3, batches=40, batch_size=256)   # epoch 3 starts at batch 40
    loader = DataLoader(dataset, batch_size=256, sampler=sampler, drop_last=True)
"""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import Dataset, DistributedSampler


class ResumableSampler(DistributedSampler):
    """Shuffled (or in-order) indices of this rank's shard, fixed by ``seed`` and the epoch.

    Args:
        dataset: what is sampled (only its length is used).
        num_replicas, rank: the data-parallel world and this process's place in it.
        shuffle: a fresh permutation every epoch; False keeps the dataset order.
        seed: the same on every rank, or the shards overlap.
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self._resume_epoch: int | None = None
        self._skip = 0

    def resume_at(self, epoch: int, batches: int, batch_size: int) -> None:
        """Start ``epoch`` after its first ``batches`` batches (every pass over that epoch)."""
        self._resume_epoch, self._skip = epoch, batches * batch_size

    def set_epoch(self, epoch: int) -> None:
        if epoch != self._resume_epoch:
            self._resume_epoch, self._skip = None, 0  # the resumed epoch is over
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        indices = super().__iter__()
        if self.epoch == self._resume_epoch and self._skip:
            # Skipped by index, before anything is loaded: resuming late in an epoch costs
            # nothing. len() stays the full epoch's: the loop counts the skipped batches as
            # done, so it expects the epoch to end where it would have.
            return iter(list(indices)[self._skip :])
        return indices
