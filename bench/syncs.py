"""Sync detector benchmark: what watching costs, and the default step's syncs before and after.

    python -m bench.syncs [--out DIR] [--steps N] [--repeats 3] [--device auto|cpu|cuda]

The benchmarks' own ResNet-18 and images (``bench.workload``) through ``Trainer.fit``,
no validation, no checkpoints. On CUDA: width 64, batch 256, bf16-mixed where supported
(the default config); on a CPU: width 16, batch 32, float32 (the CPU config's model, a
smaller batch so the run stays short).

Cost, three runs interleaved ``--repeats`` times with everything else equal:

- ``off``:     no SyncPointDetector;
- ``sampled``: ``SyncPointDetector()`` at its default budget (1% of fit time);
- ``every``:   ``SyncPointDetector(first_steps=10**9)``: every step watched.

Step time is the wall time from the end of the first step (set-up, in every mode) to the
end of the last, divided by the steps between (synchronised only at those two ends on
CUDA), after one discarded fit. Costs are ratios against ``off`` taken within each
repeat, median over the repeats: ``every / off - 1`` is the watched-step cost,
``sampled / off - 1`` the amortised cost of the whole fit at the default sampling (the
always-watched first steps included; the budget pays them back after about
``3 * watched-step cost / 1%`` steps, so the fit must be longer than that). Where the
run-to-run spread is larger than 1% (a shared CPU), the same costs are also rebuilt from
per-step medians: watched steps in the sampled fit x (median watched step - median
plain step) / the plain fit's time.

Syncs per step, every step watched, ``log_every_n_steps=10``:

- ``before``: training metrics logged with ``prog_bar=True`` and Lightning's
  ``TQDMProgressBar`` (what the template did before the sync fixes);
- ``after``:  the default config's callbacks (``LoggingStepProgressBar``,
  ``StreamPrefetcher``, ``StopOnSignal``).

Counted per watched step and per steady step (not a logging step or the one after it).

Where a watched step's time goes (``per_layer``): one step outside Lightning, timed plain,
under each of the detector's two kinds of layer left empty, and under the detector; per
Python-level call and per aten op.
On a CPU the detector simulates a GPU run (``HostMemory.on_device``: host tensors are
told apart from device tensors as a GPU run would).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import TQDMProgressBar

from bench.results import add_device_option, chosen_device, machine, save
from bench.workload import Classifier, Images, loader_workers
from gpu_busy.callbacks import (
    LoggingStepProgressBar,
    StopOnSignal,
    StreamPrefetcher,
    SyncPointDetector,
)


class StepEnds(pl.Callback):
    """Host time at the end of the first and of the last step (synchronised there), and
    at the end of every step (not synchronised: per-step times for medians)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.times: list[float] = []
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step in (1, self.steps):  # global_step counts finished steps
            if torch.cuda.is_available() and pl_module.device.type == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
        self.ends.append(time.perf_counter())

    def step_ms(self) -> list[float]:
        """Each step's host time after the first (which includes set-up)."""
        return [1e3 * (b - a) for a, b in zip(self.ends, self.ends[1:], strict=False)]


class ProgBarClassifier(Classifier):
    """The training step as it was: metrics shown through ``prog_bar=True``."""

    def log(self, name, value, *args, **kwargs):
        if self.trainer.training:
            kwargs["prog_bar"] = True
        return super().log(name, value, *args, **kwargs)


def _setup(device: str) -> dict:
    cuda = device == "cuda"
    bf16 = cuda and torch.cuda.is_bf16_supported()
    return {
        "width": 64 if cuda else 16,
        "batch_size": 256 if cuda else 32,
        "precision": "bf16-mixed" if bf16 else "32-true",
    }


def fit(device: str, steps: int, callbacks: list, model_class=Classifier) -> None:
    setup = _setup(device)
    torch.manual_seed(0)
    model = model_class(width=setup["width"])
    data = Images(
        batch_size=setup["batch_size"],
        train_size=setup["batch_size"] * steps,
        val_size=setup["batch_size"],
        num_workers=loader_workers() if device == "cuda" else 0,
        pin_memory=device == "cuda",
    )
    trainer_for(device, steps, callbacks).fit(model, data)


def trainer_for(device: str, steps: int, callbacks: list, log_every_n_steps: int = 10):
    """A Trainer for timing: no validation, logger, checkpoints or summary; a bar only if
    ``callbacks`` has one. The default set's reports go to a folder of their own, where
    Lightning would use the working directory (the project's root under ``make bench``)."""
    return pl.Trainer(
        default_root_dir=tempfile.mkdtemp(prefix="bench-reports-"),
        accelerator=device,
        devices=1,
        precision=_setup(device)["precision"],
        max_steps=steps,
        limit_val_batches=0,
        log_every_n_steps=log_every_n_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=any(isinstance(c, TQDMProgressBar) for c in callbacks),
        enable_model_summary=False,
        callbacks=callbacks,
    )


def measure_cost(device: str, steps: int, repeats: int) -> dict:
    times: dict[str, list[float]] = {"off": [], "sampled": [], "every": []}
    medians: dict[str, list[float]] = {"off": [], "every": []}
    from_medians = []  # amortised cost rebuilt from per-step medians (robust to noise)
    estimates = []
    fit(device, 12, [])  # the first fit in a process: imports, allocator, threads
    for _ in range(repeats):  # interleaved, so drift hits every mode alike
        for mode in times:
            clock = StepEnds(steps)
            callbacks: list = [clock]
            if mode == "sampled":
                detector = SyncPointDetector()
                callbacks.append(detector)
            elif mode == "every":
                callbacks.append(SyncPointDetector(first_steps=10**9))
            fit(device, steps, callbacks)
            first, last = clock.times
            times[mode].append(1e3 * (last - first) / (steps - 1))
            if mode in medians:
                medians[mode].append(statistics.median(clock.step_ms()))
            if mode == "sampled":
                estimates.append(detector.report)
                watched = detector.report["watched_batches"] - 1  # step 0 is not timed
            if mode == "every":
                extra_ms = medians["every"][-1] - medians["off"][-1]
                from_medians.append(watched * extra_ms / (medians["off"][-1] * (steps - 1)))
    med = {m: statistics.median(v) for m, v in times.items()}
    paired = {
        m: [t / off - 1 for t, off in zip(times[m], times["off"], strict=True)]
        for m in ("sampled", "every")
    }
    return {
        "step_ms": med,
        "spread_ms": {m: [min(v), max(v)] for m, v in times.items()},
        "watched_step_cost": statistics.median(paired["every"]),
        "amortised_cost": statistics.median(paired["sampled"]),
        "paired_costs": paired,
        "median_step_ms": medians,
        "watched_step_cost_from_medians": statistics.median(
            e / o - 1 for e, o in zip(medians["every"], medians["off"], strict=True)
        ),
        "amortised_cost_from_medians": statistics.median(from_medians),
        "amortised_from_medians_each": from_medians,
        "detector_estimates": [
            {k: e[k] for k in ("watched_batch_overhead", "amortised_overhead", "interval")}
            for e in estimates
        ],
    }


def per_layer(
    device: str, steps: int = 20, repeats: int = 7, width: int = 4, batch: int = 2
) -> dict:
    """Where a watched step's host time goes. One training step of the benchmarks' model,
    narrow and on a small batch so that the host's work per op shows (forward, loss,
    backward, SGD step, outside Lightning), timed plain, under an empty
    ``TorchFunctionMode`` (the function layer's mere presence), an empty
    ``TorchDispatchMode`` (the dispatch layer's), both, and under ``detect_syncs`` (the
    layers and the detector's work in them); per aten op and per Python-level call."""
    import contextlib

    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from gpu_busy.syncs import detect_syncs

    class Calls(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Calls.n += 1
            return func(*args, **(kwargs or {}))

    class Ops(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.n += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = Classifier(width=width).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    def both() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(Calls())
        stack.enter_context(Ops())
        return stack

    arms = {
        "plain": contextlib.nullcontext,
        "function mode": Calls,
        "dispatch mode": Ops,
        "both modes": both,
        "detector": lambda: detect_syncs(device_type=device),
    }
    step()  # warm-up
    ms: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(repeats):  # interleaved
        for name, arm in arms.items():
            with arm():
                Calls.n = Ops.n = 0
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                if device == "cuda":
                    torch.cuda.synchronize()
                ms[name].append(1e3 * (time.perf_counter() - t0) / steps)
                if name == "both modes":
                    calls, ops = Calls.n // steps, Ops.n // steps
    med = {name: statistics.median(v) for name, v in ms.items()}
    return {
        "calls_per_step": calls,
        "ops_per_step": ops,
        "ms_per_step": med,
        "us_per_call_function_mode": 1e3 * (med["function mode"] - med["plain"]) / calls,
        "us_per_op_dispatch_mode": 1e3 * (med["dispatch mode"] - med["plain"]) / ops,
        "detector_over_both_modes_us_per_op": 1e3 * (med["detector"] - med["both modes"]) / ops,
        "watched_step_cost": med["detector"] / med["plain"] - 1,
    }


def count_syncs(device: str, steps: int) -> dict:
    results = {}
    runs = {
        "before": (ProgBarClassifier, [TQDMProgressBar(refresh_rate=1)]),
        "after": (
            Classifier,
            [LoggingStepProgressBar(refresh_rate=10), StreamPrefetcher(), StopOnSignal()],
        ),
    }
    for name, (model_class, callbacks) in runs.items():
        detector = SyncPointDetector(first_steps=10**9)
        fit(device, steps, [*callbacks, detector], model_class=model_class)
        results[name] = sync_figures(detector)
    return results


def sync_figures(detector: SyncPointDetector) -> dict:
    """Syncs per watched and per steady step after a fit, and the sites."""
    rows = detector.table.rows()
    summary = detector.report
    return {
        "syncs_per_batch": summary["syncs_per_batch"],
        "steady_syncs_per_batch": summary["steady_syncs_per_batch"],
        "sites": [
            f"{r['op']} at {Path(r['filename']).name}:{r['lineno']}"
            + (f" via {r['via']}" if r["via"] else "")
            + f" x{r['count']} ({r['steady_count']} steady)"
            for r in rows
        ],
    }


def table(results: dict) -> str:
    cost = results["cost"]
    med, spread = cost["step_ms"], cost["spread_ms"]
    lines = ["detector cost (ms per step, median [min, max] of the repeats):"]
    for mode in ("off", "sampled", "every"):
        lo, hi = spread[mode]
        lines.append(f"  {mode:<8} {med[mode]:8.2f}  [{lo:.2f}, {hi:.2f}]")
    for name, key in (("watched step", "every"), ("amortised (default)", "sampled")):
        pct = ", ".join(f"{100 * c:+.1f}%" for c in cost["paired_costs"][key])
        median = cost["watched_step_cost" if key == "every" else "amortised_cost"]
        lines.append(f"  {name:<20} {100 * median:+.2f}% (each repeat: {pct})")
    estimates = ", ".join(
        f"{100 * e['amortised_overhead']:.2f}%"
        for e in cost["detector_estimates"]
        if e["amortised_overhead"] is not None
    )
    lines.append(
        f"  from per-step medians: watched step "
        f"{100 * cost['watched_step_cost_from_medians']:+.1f}%, amortised "
        + ", ".join(f"{100 * c:.2f}%" for c in cost["amortised_from_medians_each"])
    )
    lines.append(f"  the detector's own estimate of its fit-time cost: {estimates or 'n/a'}")
    layer = results["layers"]
    m = layer["ms_per_step"]
    lines.append(
        f"where a watched step's host time goes ({layer['calls_per_step']} Python-level calls, "
        f"{layer['ops_per_step']} aten ops per step; ms per step):"
    )
    lines.append("  " + ", ".join(f"{name} {v:.2f}" for name, v in m.items()))
    lines.append(
        f"  an empty function mode {layer['us_per_call_function_mode']:.1f} us per call, an "
        f"empty dispatch mode {layer['us_per_op_dispatch_mode']:.1f} us per op, the "
        f"detector's own work {layer['detector_over_both_modes_us_per_op']:.1f} us per op "
        f"beyond both: a watched step {100 * layer['watched_step_cost']:+.0f}%"
    )
    lines.append("syncs per step (every step watched):")
    lines.append(f"  {'':<8} {'all':>6} {'steady':>7}")
    for name in ("before", "after"):
        r = results["syncs"][name]
        lines.append(f"  {name:<8} {r['syncs_per_batch']:6.2f} {r['steady_syncs_per_batch']:7.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write syncs.json here")
    parser.add_argument("--steps", type=int, default=None, help="default: 300 CUDA, 150 CPU")
    parser.add_argument("--repeats", type=int, default=3)
    add_device_option(parser)
    args = parser.parse_args(argv)
    device = chosen_device(parser, args.device)
    steps = args.steps or (300 if device == "cuda" else 150)
    if steps < 20:
        parser.error("--steps must be 20 or more")
    results = {
        "cost": measure_cost(device, steps, args.repeats),
        "syncs": count_syncs(device, 40),
        "layers": per_layer(device),
    }
    results["machine"] = machine("bench.syncs", device, argv, setup=_setup(device), steps=steps)
    save(results, args.out, "syncs.json")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
