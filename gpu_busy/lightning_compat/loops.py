"""Where Lightning's training loop is: the epoch and batch a checkpoint resumes at, and the
batches its data fetcher has read ahead.

Example::

    epoch, trained = epoch_position(trainer)    # in on_save_checkpoint
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


def epoch_position(trainer: pl.Trainer) -> tuple[int, int]:
    """``(epoch, batches of it trained)`` for the next training batch, read while a
    checkpoint is written.

    From a mid-epoch save (``on_train_batch_end``, a mid-epoch validation) that is the
    current epoch and the batches run so far, the one just trained included; from an
    epoch-end save it is ``(next epoch, 0)``.
    """
    # Public attributes, but what ``processed`` means at save time (the batch that just ran
    # is counted; ``completed`` is not yet) is Lightning's loop bookkeeping (2.0 to 2.6),
    # pinned by tests/contracts/test_lightning_compat.py and tests/resume/test_resume.py.
    trained = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
    epoch = int(trainer.current_epoch)
    if trained >= trainer.num_training_batches:
        return epoch + 1, 0
    return epoch, trained


def fetcher_counts(loop: Any) -> tuple[int | None, int, int]:
    """``(length, fetched, lookahead)`` of the loop's data fetcher in the current pass.

    Lightning's fetcher stops asking its CombinedLoader for batches once ``fetched``
    reaches ``length`` (None for loaders without one); there it keeps ``lookahead``
    batches ahead of what the loop has consumed. ``fetched`` includes the batches a
    resumed epoch skipped, so it is on the same scale as the loop's ``batch_progress``.
    """
    # Private: loop._data_fetcher and its .length / .fetched / .prefetch_batches
    # (Lightning 2.1 to 2.6).
    fetcher = loop._data_fetcher
    length = None if fetcher.length is None else int(fetcher.length)
    lookahead = 0 if length is not None else int(getattr(fetcher, "prefetch_batches", 0))
    return length, int(fetcher.fetched), lookahead


def fetched_ahead(loop: Any) -> list:
    """The batches the loop's fetcher has already read and holds for the next steps (a
    loader without a length: Lightning reads one ahead, at ``iter()``, before any hook of
    the pass), as ``(batch, batch_idx, dataloader_idx)``; the list itself, to replace in."""
    # Private: loop._data_fetcher.batches (_PrefetchDataFetcher, Lightning 2.0 to 2.6).
    fetcher = getattr(loop, "_data_fetcher", None)
    batches = getattr(fetcher, "batches", None)
    return batches if isinstance(batches, list) else []


def combined_loader(loop: Any) -> Any | None:
    """The CombinedLoader a loop's fetcher iterates, or None before the loop has one."""
    # Private: loop._combined_loader (Lightning 2.0 to 2.6).
    return getattr(loop, "_combined_loader", None)
