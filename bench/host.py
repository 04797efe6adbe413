"""Host cost: what the default config's callbacks and plugin add to each step, on the CPU.

    python -m bench.host [--out DIR] [--steps 400] [--repeats 7] [--device cpu|cuda|auto]

The host's work per step is the same work on a GPU machine, so it is measured on the CPU
by default, on a model whose step is one ``nn.Linear`` on 8 features: the loop's host work
and nothing else (``--device cuda`` runs the same fits on a GPU, where the device's event
records and queries join it). Every callback and plugin that ``configs/default.yaml``
lists is built from it.

- **Loop.** Three kinds of fit, interleaved ``--repeats`` times, every other repeat in
  reverse order, so drift hits all alike:
  ``plain`` PyTorch (the same model, DataLoader and optimizer, no Lightning),
  ``lightning`` (a bare Trainer: the same CSV logger, no bar, no checkpoints) and
  ``template`` (the bare Trainer plus the default callbacks and plugin). Each fit's step
  is the median host time from one step's end to the next, after 20 steps. Lightning's
  own cost is ``lightning - plain``; ours is ``template - lightning``, per repeat, with
  the spread, and between each kind's fastest fit (where a shared machine's speed wanders,
  the least disturbed; the goal is judged there). The goal: ours at most 10% of the bare
  Lightning step. Ours is net of the Lightning work our settings skip
  (``lightning_compat.lighter_dispatch``).
- **Per callback.** One more fit with the callbacks, their hooks (and the plugin's save)
  each timed, exclusive of the hooks they call, and the reads of each routing layer a
  callback puts on the loader: ms per steady step, per logging step and per save, and once
  per fit (set-up, epoch ends, reports). What they do not explain (wrappers around
  Lightning's functions, less the dispatch our settings skip) is the loop's cost less their
  sum.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import yaml
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bench import cuda_calls
from bench.results import chosen_device, machine, save
from gpu_busy import defaults
from gpu_busy import lightning_compat as compat
from gpu_busy.callbacks.step_clock import StepClock
from gpu_busy.cuda_runtime import replaced_by

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
FEATURES, BATCH, LOG_EVERY, SKIP = 8, 8, 20, 20
DEVICE = ["cpu"]  # where the fits run (run's device)
# Hooks Lightning calls on callbacks, and the calls it makes on them directly at a save.
TIMED = (
    *(n for n in dir(pl.Callback) if n.startswith("on_") or n in ("setup", "teardown")),
    "state_dict",
)
DATA = "(the DataLoader: not ours)"
TRAIN_BATCH_HOOKS = {n for n in compat.BATCH_HOOKS if "_validation_" not in n and "_test_" not in n
                     and "_predict_" not in n}  # fmt: skip


class NearFree(pl.LightningModule):
    """One linear layer: the step costs the loop's host work and almost nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(FEATURES, 2)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.layer(x), y)
        self.log("train/loss", loss)  # converted at logging steps only
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        self.log("val/acc", (self.layer(x).argmax(1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader(steps: int, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    n = steps * BATCH
    data = TensorDataset(
        torch.randn(n, FEATURES, generator=g), torch.randint(0, 2, (n,), generator=g)
    )
    return DataLoader(data, batch_size=BATCH, pin_memory=DEVICE[0] == "cuda")


def default_config_parts() -> tuple[list[pl.Callback], list[Any]]:
    """The callbacks and plugins ``make train`` gets: ``gpu_busy.defaults()`` with the
    options ``configs/default.yaml`` gives it."""
    parts = defaults(**yaml.safe_load(CONFIG.read_text())["gpu_busy"])
    return parts["callbacks"], parts["plugins"]


class _StepEnds(pl.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ends.append(time.perf_counter())

    def median_ms(self) -> float:
        return _median_step_ms(self.ends)


def _trainer(folder: str, steps: int, callbacks: list, plugins: list | None, **kw) -> pl.Trainer:
    return pl.Trainer(
        accelerator=DEVICE[0],
        devices=1,
        max_steps=steps,
        log_every_n_steps=LOG_EVERY,
        logger=CSVLogger(folder),
        enable_checkpointing=plugins is not None,
        enable_progress_bar=plugins is not None,
        enable_model_summary=False,
        callbacks=callbacks,
        plugins=plugins,
        **kw,
    )


def lightning_step_ms(steps: int, template: bool, folder: str) -> float:
    clock = _StepEnds()
    callbacks, plugins = default_config_parts() if template else ([], None)
    trainer = _trainer(folder, steps, [clock, *callbacks], plugins, limit_val_batches=0)
    torch.manual_seed(0)
    trainer.fit(NearFree(), _loader(steps))
    return clock.median_ms()


def plain_step_ms(steps: int) -> float:
    """The same model, data and optimizer in a plain PyTorch loop."""
    torch.manual_seed(0)
    device = torch.device(DEVICE[0])
    model = NearFree().to(device)
    optimizer = model.configure_optimizers()
    ends = []
    for x, y in _loader(steps):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = nn.functional.cross_entropy(model.layer(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ends.append(time.perf_counter())
    return _median_step_ms(ends)


def _median_step_ms(ends: list[float]) -> float:
    """The median time from one step's end to the next, after the first ``SKIP`` steps."""
    return statistics.median(1e3 * (b - a) for a, b in itertools.pairwise(ends[SKIP:]))


def loop(steps: int, repeats: int) -> dict:
    ms: dict[str, list[float]] = {"plain": [], "lightning": [], "template": []}
    with tempfile.TemporaryDirectory() as folder:
        lightning_step_ms(40, True, folder)  # the first fits: imports, threads, allocator
        lightning_step_ms(40, False, folder)
        fits = {
            "plain": lambda: plain_step_ms(steps),
            "lightning": lambda: lightning_step_ms(steps, False, folder),
            "template": lambda: lightning_step_ms(steps, True, folder),
        }
        for repeat in range(repeats):
            # every other repeat in reverse order: a drift in the machine's speed hits the
            # kinds alike instead of always the last one most
            for kind in list(fits)[:: 1 if repeat % 2 == 0 else -1]:
                ms[kind].append(fits[kind]())
    ours = [t - b for t, b in zip(ms["template"], ms["lightning"], strict=True)]
    ratios = [t / b for t, b in zip(ms["template"], ms["lightning"], strict=True)]
    lightning_own = [b - p for b, p in zip(ms["lightning"], ms["plain"], strict=True)]
    fastest = {k: min(v) for k, v in ms.items()}
    return {
        "step_ms": {k: statistics.median(v) for k, v in ms.items()},
        # each kind's fastest fit: the machine's speed with the least interference (timeit's
        # reasoning); the paired ratios below spread where its speed changed within a repeat
        "fastest_step_ms": fastest,
        "fastest_ours_ms": fastest["template"] - fastest["lightning"],
        "fastest_ratio": fastest["template"] / fastest["lightning"],
        "step_ms_each": ms,
        "lightning_own_ms": statistics.median(lightning_own),
        "ours_ms": statistics.median(ours),
        "ours_ms_each": ours,
        "ratio": statistics.median(ratios),
        "ratio_each": ratios,
    }


class _HookTimes:
    """Exclusive host time of every callback hook and plugin save, bucketed by where the
    loop was: a steady training step, a logging step, a save, or elsewhere in the fit."""

    def __init__(self) -> None:
        self.ms: dict[tuple[str, str], float] = {}
        self.steps = {"steady": 0, "logging": 0}
        self.saves = 0
        self._stack: list[float] = []  # nested time of the open calls' inner timed calls
        self._open: list[tuple[str, bool]] = []  # the open calls' rows, and step_hook
        self._batch = "fit"  # before the first batch: the fit's set-up
        self._saving = 0

    def wrap(self, owner: Any, name: str, row: str, save: bool = False) -> None:
        fn = getattr(owner, name, None)
        if not callable(fn) or getattr(fn, "_timed", False):
            return

        step_hook = name in TRAIN_BATCH_HOOKS

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._saving += save
            try:
                return self.call(fn, *args, row=row, step_hook=step_hook, **kwargs)
            finally:
                self._saving -= save

        timed._timed = True
        setattr(owner, name, timed)

    def wrap_layer(self, make_iterator, row: str):
        """A routing layer's iterator, each read timed as ``row``'s (counted with the step
        before it: the loop reads the next batch before the next step's hooks)."""
        times = self

        class Below:  # what the layer reads from: at the bottom, the DataLoader
            def __init__(self, items) -> None:
                self.items = items

            def __iter__(self):
                return self

            def __next__(self):
                return times.call(next, self.items, row=DATA)

        class Timed:
            def __init__(self, items) -> None:
                self.items = make_iterator(Below(items))

            def __iter__(self):
                return self

            def __next__(self):
                return times.call(next, self.items, row=row)

        return Timed

    def call(self, fn, *args, row: str, step_hook: bool = True, **kwargs):
        """``fn(*args, **kwargs)``, its time less that of the timed calls inside it added to
        ``row`` in the bucket of where the loop is (a step's own hooks and reads: the
        step's kind; anything else: the fit)."""
        self._stack.append(0.0)
        self._open.append((row, step_hook))
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.perf_counter() - t0
            inner = self._stack.pop()
            self._open.pop()
            if self._stack:
                self._stack[-1] += spent
            bucket = self._bucket(step_hook)
            self.ms[(row, bucket)] = self.ms.get((row, bucket), 0.0) + 1e3 * (spent - inner)

    def _bucket(self, step_hook: bool) -> str:
        return "save" if self._saving else (self._batch if step_hook else "fit")

    def bucket(self) -> str:
        """Where the loop is, as the innermost open call counts it."""
        return self._bucket(self._open[-1][1] if self._open else True)

    def batch_starts(self, logging_step: bool) -> None:
        self._batch = "logging" if logging_step else "steady"
        self.steps[self._batch] += 1


class _Instrument(pl.Callback):
    """First in the list: tells each batch's kind, and at the first batch wraps every
    callback's hooks, once the callbacks' own set-up has placed them (the step clock's two
    marks are named after it). Last in the list (``layers=True``): at each epoch's start,
    after the callbacks routed the loader, times each routing layer's reads."""

    # whose routing layer each is (gpu_busy.batch_routing layer names)
    LAYERS = (("clock-", "StepClock"), ("syncs-", "SyncPointDetector"),
              ("stop-on-signal", "StopOnSignal"), ("prefetch", "StreamPrefetcher"))  # fmt: skip

    def __init__(self, times: _HookTimes, names: dict[int, str], layers: bool = False) -> None:
        self.times, self.names, self._wrapped, self.layers = times, names, False, layers

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        loader = compat.combined_loader(trainer.fit_loop)
        for name, (position, make) in list(getattr(loader, "_routing_layers", {}).items()):
            if self.layers and not getattr(make, "_timed", False):
                row = next((r for prefix, r in self.LAYERS if name.startswith(prefix)), name)
                timed = self.times.wrap_layer(make, row)
                timed._timed = True
                loader._routing_layers[name] = (position, timed)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not self.layers:
            self.times._batch = "fit"  # the next epoch's first read is no step's

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.layers:
            return
        if not self._wrapped:
            self._wrapped = True
            self._wrap(trainer)
        self.times.batch_starts(compat.is_logging_step(trainer))

    def _wrap(self, trainer: pl.Trainer) -> None:
        clock = StepClock.of(trainer)
        edges = {id(e) for e in clock._edges} if clock is not None else set()
        for cb in trainer.callbacks:
            if isinstance(cb, _Instrument):
                continue
            row = "StepClock" if id(cb) in edges else self.names.get(id(cb), type(cb).__name__)
            for name in TIMED:
                self.times.wrap(cb, name, row)
        plugin = trainer.strategy.checkpoint_io
        self.times.wrap(plugin, "save_checkpoint", type(plugin).__name__, save=True)
        original = trainer.save_checkpoint

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            self.times.saves += 1
            self.times._saving += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.times._saving -= 1

        trainer.save_checkpoint = save_checkpoint


def per_callback(steps: int, epochs: int = 3, count_cuda: bool = False) -> dict:
    """One fit of ``epochs`` with validation and the default saves, every hook timed;
    ``count_cuda``: along the CUDA route, every CUDA call counted (``bench.cuda_calls``)."""
    callbacks, plugins = default_config_parts()
    names = {id(c): type(c).__name__ for c in callbacks}
    if sum(1 for c in callbacks if type(c).__name__ == "ModelCheckpoint") == 1:
        names.update({id(c): "ModelCheckpoint (last)" for c in callbacks
                      if type(c).__name__ == "ModelCheckpoint"})  # fmt: skip
    times = _HookTimes()
    counting = None
    if count_cuda:
        counting = cuda_calls.CountingCuda(lambda: (cuda_calls.caller(names), times.bucket()))
    instrument, layers = _Instrument(times, names), _Instrument(times, names, layers=True)
    with tempfile.TemporaryDirectory() as folder:
        trainer = _trainer(
            folder, steps * epochs, [instrument, *callbacks, layers], plugins,
            max_epochs=epochs, limit_val_batches=4, num_sanity_val_steps=0,
        )  # fmt: skip
        torch.manual_seed(0)
        with replaced_by(counting) if counting else contextlib.nullcontext():
            trainer.fit(NearFree(), _loader(steps), _loader(4, seed=1))
    if counting is not None:
        return {
            "steps": times.steps,
            "saves": times.saves,
            "per_step": cuda_calls.per_step(counting.counts, times.steps, times.saves),
        }
    rows: dict[str, dict[str, float | None]] = {}
    for (row, bucket), ms in times.ms.items():
        r = rows.setdefault(row, {"steady": 0.0, "logging": 0.0, "save": 0.0, "fit": 0.0})
        r[bucket] += ms
    for r in rows.values():
        for bucket, n in (*times.steps.items(), ("save", times.saves)):
            r[bucket] = r[bucket] / n if n else None
    return {"rows": rows, "steps": times.steps, "saves": times.saves}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.host", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, default=None, help="write host.json here")
    parser.add_argument("--steps", type=int, default=400, help="steps per timed fit")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repeats")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--cuda-route",
        action="store_true",
        help="count the CUDA calls the callbacks make per step, on the CPU (bench.cuda_calls)",
    )
    args = parser.parse_args(argv)
    if args.cuda_route:
        result = cuda_route(args.steps // 2)
        save({"cuda_route": result, "machine": machine("bench.host", "cpu", argv)}, args.out,
             "cuda_calls.json")  # fmt: skip
        print("\n".join(cuda_calls.table(result)))
        return 0
    device = chosen_device(parser, args.device)
    results = run(args.steps, args.repeats, device)
    results["machine"] = machine("bench.host", device, argv)
    save(results, args.out, "host.json")
    print(f"device: {results['machine']['device']}; torch {torch.__version__}, "
          f"lightning {pl.__version__}")  # fmt: skip
    print("\n".join(table(results)))
    return 0


def cuda_route(steps: int = 100) -> dict:
    """The default callbacks' CUDA calls per step, counted on the CPU (``bench.cuda_calls``)."""
    DEVICE[0] = "cpu"
    logging.disable(logging.WARNING)
    try:
        return per_callback(steps, epochs=2, count_cuda=True)
    finally:
        logging.disable(logging.NOTSET)


def run(steps: int, repeats: int, device: str = "cpu") -> dict:
    DEVICE[0] = device
    logging.disable(logging.WARNING)  # the fits' own reports, not the benchmark's
    try:
        return {"loop": loop(steps, repeats), "per_callback": per_callback(steps // 2)}
    finally:
        logging.disable(logging.NOTSET)


def table(results: dict) -> list[str]:
    lp, pc = results["loop"], results["per_callback"]
    s, f = lp["step_ms"], lp["fastest_step_ms"]
    lines = [
        f"loop, median step (ms, {len(lp['ratio_each'])} interleaved repeats): plain PyTorch "
        f"{s['plain']:.3f}, bare Lightning {s['lightning']:.3f}, with the default callbacks "
        f"{s['template']:.3f}",
        f"  Lightning's own per step: {lp['lightning_own_ms']:+.3f} ms; the callbacks': "
        f"{lp['ours_ms']:+.3f} ms (repeats {_spread(lp['ours_ms_each'], '+.3f')}); "
        f"with / without {lp['ratio']:.3f} (repeats {_spread(lp['ratio_each'], '.3f')})",
        f"  each kind's fastest fit: bare Lightning {f['lightning']:.3f}, with the callbacks "
        f"{f['template']:.3f}: the callbacks' {lp['fastest_ours_ms']:+.3f} ms, with / without "
        f"{lp['fastest_ratio']:.3f}; goal <= 1.10",
        "",
        f"per callback, host ms exclusive of nested hooks ({pc['steps']['steady']} steady steps, "
        f"{pc['steps']['logging']} logging steps, {pc['saves']} saves)",
        f"{'callback':<28}{'steady step':>12}{'logging step':>14}{'per save':>10}{'per fit':>10}",
    ]
    rows = sorted(pc["rows"].items(), key=lambda kv: -(kv[1]["steady"] or 0.0))
    for name, r in rows:
        lines.append(
            f"{name:<28}{_ms(r['steady']):>12}{_ms(r['logging']):>14}{_ms(r['save']):>10}"
            f"{_ms(r['fit'], '.1f'):>10}"
        )
    hooks = sum(r["steady"] or 0.0 for name, r in pc["rows"].items() if name != DATA)
    lines.append(f"{'all of the above':<28}{hooks:>12.4f}")
    outside = lp["ours_ms"] - hooks
    lines.append(
        f"{'the rest':<28}{outside:>12.4f}   (the loop's cost less the above: wrappers, less "
        "the Lightning dispatch our settings skip)"
    )
    return lines


def _ms(x: float | None, spec: str = ".4f") -> str:
    return "n/a" if x is None else format(x, spec)


def _spread(values: list[float], spec: str) -> str:
    return f"[{format(min(values), spec)}, {format(max(values), spec)}]"


if __name__ == "__main__":
    sys.exit(main())
