"""Reads of logged values per training step: Lightning's conversions of ``prog_bar=True``
values and of what it hands the loggers, with the default config's callbacks, before and
after the template's ``lightning_compat.prog_bar_numbers_when_read``.

    python -m bench.logged_reads [--steps 42]

A module logs three values with ``prog_bar=True`` and one without, every step; a read is
an ``.item()`` or ``.tolist()`` of a tensor that is not a host copy, or a blocking copy to
the host, counted by the function that made it. "before" runs the same fit with the
conversion left to Lightning. Pinned by tests/whole/test_logged_values.py.
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
import tempfile
import weakref
from collections.abc import Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from bench.host import default_config_parts
from gpu_busy import lightning_compat as compat
from gpu_busy.patches import patch

LOG_EVERY = 10
# Lightning's conversion, and the template's one copy
LOGGED_VALUE_READERS = frozenset(["to_item", "numbers_in_one_copy"])


class ThreeOnTheBar(BoringModel):
    """Three prog_bar values and one without, every step: the module the issue measured."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        loss = out["loss"]
        self.log("a", loss, prog_bar=True)
        self.log("b", loss * 2, prog_bar=True)
        self.log("c", loss * 3, prog_bar=True)
        self.log("d", loss * 4)
        return out


class CountReads(pl.Callback):
    """Reads of device values (``.item()``, ``.tolist()``, a blocking copy to the host) in
    each training step's window, by the function that made them. On the CPU every tensor
    counts as device memory except the host copies a copy made, whose reads are free."""

    def __init__(self) -> None:
        self.by_step: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self.logging: set[int] = set()
        self._host: dict[int, weakref.ref] = {}  # live host copies, by their memory
        self._step = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if compat.is_logging_step(trainer):
            self.logging.add(self._step)
        self._step += 1  # the loop's work after a step is the next step's

    def install(self) -> Callable[[], None]:
        """Count from now on; returns the undo."""
        undos = [
            *(
                patch(torch.Tensor, n, self._read(getattr(torch.Tensor, n)))
                for n in ("item", "tolist")
            ),
            patch(torch.Tensor, "cpu", self._copy(torch.Tensor.cpu, blocking=True)),
            patch(torch.Tensor, "to", self._copy(torch.Tensor.to, blocking=None)),
        ]
        return lambda: [undo() for undo in reversed(undos)] and None

    def _count(self) -> None:
        caller = sys._getframe(2).f_code.co_name
        self.by_step[self._step][caller] += 1

    def _read(self, original):
        def read(tensor, *args, **kwargs):
            copy = self._host.get(tensor.untyped_storage().data_ptr(), lambda: None)()
            if copy is None:  # not a live host copy's memory (a view of one is)
                self._count()
            return original(tensor, *args, **kwargs)

        return read

    def _copy(self, original, blocking):
        def copy(tensor, *args, **kwargs):
            out = original(tensor, *args, **kwargs)
            to_host = blocking or (str(args[0] if args else kwargs.get("device")) == "cpu")
            if to_host and isinstance(out, torch.Tensor):
                if blocking or not kwargs.get("non_blocking", False):
                    self._count()
                self._host[out.untyped_storage().data_ptr()] = weakref.ref(out)
            return out

        return copy


def counted_fit(steps: int, lightning_converts: bool) -> CountReads:
    """One fit of ``ThreeOnTheBar`` under the default config's callbacks, its reads counted
    (``lightning_converts``: as without the template's bar)."""
    callbacks, plugins = default_config_parts()
    count = CountReads()
    kept = lambda trainer: lambda: None  # noqa: E731
    undo_bar = patch(compat, "prog_bar_numbers_when_read", kept) if lightning_converts else None
    with tempfile.TemporaryDirectory() as folder:
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=steps, log_every_n_steps=LOG_EVERY,
            callbacks=[*callbacks, count], plugins=plugins, logger=pl.loggers.CSVLogger(folder),
            default_root_dir=folder, enable_model_summary=False,
        )  # fmt: skip
        uncount = count.install()
        try:
            trainer.fit(ThreeOnTheBar())
        finally:
            uncount()
            if undo_bar is not None:
                undo_bar()
    return count


def reads_per_step(steps: int, lightning_converts: bool) -> tuple[float, float]:
    """(reads of logged values per steady step, per logging step) over one fit."""
    count = counted_fit(steps, lightning_converts)
    handed = {s + 1 for s in count.logging if s + 1 < steps}  # the step after: see CountReads
    steady = [s for s in range(1, steps - 1) if s not in handed]

    def per(kind: list[int]) -> float:
        found = (n for s in kind for k, n in count.by_step[s].items() if k in LOGGED_VALUE_READERS)
        return sum(found) / max(1, len(kind))

    return per(steady), per(sorted(handed))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=42)
    args = parser.parse_args(argv)
    print(f"reads of logged values per step (3 prog_bar values, log_every_n_steps={LOG_EVERY})")
    print(f"{'':28}{'steady step':>12}{'logging step':>14}")
    logging.disable(logging.WARNING)  # the fits' own reports, not the benchmark's
    try:
        for name, lightning_converts in (("before (Lightning converts)", True), ("now", False)):
            steady, at_logging = reads_per_step(args.steps, lightning_converts)
            print(f"{name:28}{steady:12.2f}{at_logging:14.2f}", flush=True)
    finally:
        logging.disable(logging.NOTSET)
    return 0


if __name__ == "__main__":
    sys.exit(main())
