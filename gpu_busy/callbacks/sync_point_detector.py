"""SyncPointDetector: which lines make the host wait for the GPU, step by step.

Watches the first steps, then a sample within ``overhead_budget`` of the fit, the same
steps on every rank, each from the previous step's end to its own; ``strict=True`` fails
at the first sync outside set-up and logging steps. On a CPU-only run CPU tensors count
as device memory. Figures: ``syncs/*``, and at the end every site with a fix
(``syncs.json``). Details: docs/GUIDE.md and docs/ARCHITECTURE.md, "Finding host-device
syncs".

Example::

    trainer = Trainer(callbacks=[SyncPointDetector()])          # watch a 1% sample
    trainer = Trainer(callbacks=[SyncPointDetector(strict=True)])   # fail CI on a sync
"""

from __future__ import annotations

import contextlib

import lightning.pytorch as pl

from gpu_busy import batch_routing
from gpu_busy import lightning_compat as compat
from gpu_busy.callbacks.measurement import Measurement
from gpu_busy.callbacks.ranks import gather_objects, gather_rows, log_metrics, publish, run_dir
from gpu_busy.callbacks.step_clock import StepClock
from gpu_busy.log import get_logger
from gpu_busy.report import syncs as syncs_report
from gpu_busy.syncs.attribution import OPTIMIZER_STEP, SyncError
from gpu_busy.syncs.detector import SyncDetector
from gpu_busy.syncs.memory import (
    SlotKinds,
    held_host_devices,
    held_outside_parameters,
    refilled_slots,
)
from gpu_busy.syncs.rules import DDP_USED_MAP, LIGHTNING_READS
from gpu_busy.syncs.sampling import WatchedSums, WatchSchedule
from gpu_busy.syncs.sites import SyncSiteTable, github_annotations, in_github_actions
from gpu_busy.syncs.watched_steps import WatchedSteps

log = get_logger(__name__)

_MAX_ROWS = 64  # per-step counts sent per logging window (a fixed size for all_gather)
_PHASE_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")


class SyncPointDetector(Measurement):
    """Watch a sample of training steps for host-device syncs and report their lines.

    Args:
        overhead_budget: share of training time the watched steps may cost (0.01 = 1%).
        first_steps: batches watched at the start of every fit, whatever they cost. None:
            3, or fewer where the fit's length is known and 3 would not fit the budget.
        strict: raise at the first sync in a watched steady step (not a callback's hooks).
            A fit in which no watched step was steady (a one-batch test) checked nothing:
            it fails too, with a ``SyncError`` that says how to make it check one. The
            default set takes it from ``Options.strict`` (docs/GUIDE.md, "Options").
        device_type: which tensors count as device memory; None follows the root device.
        log_stats: write ``syncs/*`` at Lightning's logging steps.
    """

    made_per_fit = ("detector", "steps", "_clock", "_unwrap", "_slots")
    logs_earlier_steps = True  # syncs/count of each watched step, at its step (StepClock)

    label, report_name = "sync detection", "syncs"

    def must_raise(self) -> bool:
        return self.strict  # under strict a check, not a measurement

    def __init__(
        self,
        overhead_budget: float = 0.01,
        first_steps: int | None = None,
        strict: bool = False,
        device_type: str | None = None,
        log_stats: bool = True,
    ) -> None:
        self.schedule = WatchSchedule(budget=overhead_budget, first=first_steps or 3)
        self._fit_first_to_budget = first_steps is None
        self.strict = strict
        self.device_type = device_type
        self.log_stats = log_stats
        self.detector: SyncDetector | None = None
        self._unwrap: contextlib.ExitStack | None = None
        # next to the DataLoader: what it hands over, before any other layer moves it
        self._layer = batch_routing.Layer(f"syncs-{id(self):x}", position=-2)
        self.report: dict = {}
        self._clock: StepClock | None = None
        self._first_global_step = 0
        self._made_in_init: list = []  # tensors the module keeps outside its parameters
        self._slots = SlotKinds([])  # where it keeps them in a buffer: (owner, attribute)
        self._host_devices: list = []  # the torch.device("cpu") objects it keeps
        self._reset_run()

    def _reset_run(self, costs: bool = False) -> None:
        # this rank's sites in this fit; after it, every rank's
        self.table = SyncSiteTable(LIGHTNING_READS, costs=costs)
        self.steps: WatchedSteps | None = None
        # (logger step, epoch, syncs, steady) of the watched steps since the last log
        self._rows: list[tuple[int, int, int, bool]] = []
        self._window_rows: list[tuple[int, int, int, bool]] = []  # the window being logged
        self.totals = WatchedSums()  # this rank's, in this fit
        # watched, plain, the plain steps' upper quartile (s)
        self._costs: tuple[float | None, ...] = (None, None, None)

    # -- the watched windows: where the loop is, told to WatchedSteps --------------------

    def setup(self, trainer, pl_module, stage) -> None:
        # Before the module's own setup and the move to the device: what __init__ made.
        if stage == "fit":  # on_train_start takes them (only a fit watches)
            self._made_in_init = held_outside_parameters(pl_module)
            self._slots = SlotKinds(refilled_slots(pl_module))
            self._host_devices = held_host_devices(pl_module)

    def on_train_start(self, trainer, pl_module) -> None:
        device_type = self.device_type or trainer.strategy.root_device.type
        # Lightning's prog_bar conversions are reported at the lines that logged them.
        logged_at = compat.LoggedAt()
        self._unwrap = contextlib.ExitStack()
        self._unwrap.enter_context(logged_at.install())
        self.detector = SyncDetector(
            device_type, origins=(logged_at.origin,), chain_hints=LIGHTNING_READS
        )
        self._reset_run(costs=not self.detector.memory.simulating)
        # On a GPU they stay on the host, where __init__ made them: each use on the device is
        # a blocking copy there, and the simulation counts it so
        self.detector.memory.mark_host(*self._made_in_init)
        self.detector.memory.devices_on_the_host(*self._host_devices)
        self._made_in_init, self._host_devices = [], []
        batches = trainer.estimated_stepping_batches * trainer.accumulate_grad_batches
        if self._fit_first_to_budget and not self.schedule.plan_fit(batches):
            log.info(
                "SyncPointDetector: a fit of %d batches is too short to keep even one watched "
                "batch within %.0f%% of its time (a watched batch costs about +%.0f%%); "
                "watching one, the second (the first has no step before it to see)",
                batches,
                100 * self.schedule.budget,
                100 * self.schedule.PRIOR_EXTRA,
            )
        self.steps = WatchedSteps(
            self.detector, self.schedule, self.strict, on_open=lambda: self._window_opens(trainer)
        )
        if self.strict:  # strict covers the step and the loop's work, never a callback's hooks
            self._unwrap.callback(
                compat.around_callback_hooks(self.steps.hooks_begin, self.steps.hooks_end)
            )
        if self.detector.memory.simulating and trainer.strategy.root_device.type == "cpu":
            # Lightning moves to the device as it does to a GPU (on a GPU run told to
            # simulate, its copies to the host must stay blocking)
            self._unwrap.callback(compat.moves_to_the_cpu_as_to_cuda())
        self._first_global_step = trainer.global_step
        # the counts ride the fit's one window; its clock says when training started
        self._clock = StepClock.subscribe(trainer, self)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self.steps is not None:
            self.steps.epoch_starts()
        if self.detector is not None and self.steps is not None:
            # At each batch the DataLoader hands over (a new loader each epoch with
            # reload_dataloaders_every_n_epochs): simulated, it is host memory until moved,
            # as on a GPU; an epoch's first opens its step's window, before Lightning moves it
            self._layer.route(
                trainer.fit_loop, lambda items: batch_routing.EachItem(items, self._read)
            )

    def _read(self, batch) -> None:
        if self.steps.batch_read():  # first: the window the batch is marked in
            self._phases_seen(self.steps.watching)
        self.detector.memory.batch_from_host(batch)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.steps is not None:
            self.steps.step_starts(logging=compat.is_logging_step(trainer))
            self._phases_seen(self.steps.watching)  # an epoch's first window opens here

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._phase("backward")

    def on_after_backward(self, trainer, pl_module) -> None:
        self._phase("after backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._phase(OPTIMIZER_STEP)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.steps is None:
            return
        logging_now = compat.is_logging_step(trainer)
        self._count_window(trainer, logging_now)
        if not logging_now:
            self._next_window()
        # else: the fit's window gathers first, outside any watched one (log_window)

    def _count_window(self, trainer, logging: bool) -> None:
        """Close the step's window; a watched one goes into the table and the totals."""
        watched = self.steps.step_ends(logging=logging)
        if watched is not None:
            events, steady = watched
            if self.detector.memory.simulating:
                self._slots.window_closes(self.detector.memory)
            step = compat.logger_step(trainer)
            first = self.steps.steps == 1  # the fit's first window just closed
            self.table.add_all(events, step=step, logging=not steady, first=first)
            n = sum(not e.cpu_only for e in events)  # a GPU's syncs
            self._rows.append((step, trainer.current_epoch, n, steady))
            self.totals.add(WatchedSums(1, n, int(steady), n if steady else 0))

    def _next_window(self) -> None:
        self.steps.next_window()
        self._phases_seen(self.steps.watching)

    def _phases_seen(self, watching: bool) -> None:
        """The phase hooks only in a watched step: Lightning calls none in the others."""
        skipped = self.__dict__.get(_PHASE_HOOKS[0], "") is None
        if skipped != watching:
            return  # as wanted already (most steps: skipped, not watched)
        compat.skip_hooks(self, _PHASE_HOOKS, skip=not watching)

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit" and self.steps is not None:
            self.steps.pause()

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit" and self.steps is not None:
            self.steps.resume()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.steps is not None:
            self.steps.epoch_ends()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._close()

    def teardown(self, trainer, pl_module, stage) -> None:
        self._close()
        if (clock := StepClock.of(trainer)) is not None:
            clock.remove(trainer)

    def _close(self) -> None:
        self._phases_seen(True)
        self._layer.remove()
        if self._unwrap is not None:
            self._unwrap.close()
        if self.steps is not None:
            self.steps.close()

    def _window_opens(self, trainer: pl.Trainer) -> None:
        """What the detector must know as a watched step begins: DDP's map copied to the
        host and, in the simulation, where the tensors put in the module's slots since the
        last watched step live (``SlotKinds``)."""
        memory = self.detector.memory
        used_map = compat.ddp_used_parameter_map(trainer)
        if used_map is not None:
            memory.copies_to_host(used_map, *DDP_USED_MAP)
        if memory.simulating:
            self._slots.window_opens(memory)

    def _phase(self, name: str) -> None:
        if self.steps is not None:
            self.steps.phase(name)

    # -- figures -------------------------------------------------------------------

    def window_row(self) -> list[float]:
        """This rank's window: the watched steps' sync counts and the costs measured."""
        self._window_rows, self._rows = self._rows[-_MAX_ROWS:], []
        return [
            float(len(self._window_rows)),
            float(sum(r[2] for r in self._window_rows)),
            *map(_or_nan, self.schedule.estimate()),
            *[float(r[2]) for r in self._window_rows],
            *[0.0] * (_MAX_ROWS - len(self._window_rows)),
        ]

    def log_window(self, trainer, gathered: list[list[float]]) -> None:
        """Every rank's window: re-plan sampling, log on rank zero, then open the next
        watched step's window (after the gather, which is no step's)."""
        try:
            self._log_gathered(trainer, gathered)
        finally:
            self._next_window()

    def _log_gathered(self, trainer, gathered: list[list[float]]) -> None:
        rows = self._window_rows
        watched_s, plain_s, plain_high_s = WatchSchedule.costliest([r[2:5] for r in gathered])
        self.schedule.update(watched_s, plain_s, plain_high_s)
        self._costs = (watched_s, plain_s, plain_high_s)
        if not self.log_stats:
            return
        n = int(gathered[0][0])
        world = len(gathered)
        per_step = [sum(r[5 + i] for r in gathered) / world for i in range(n)]
        for (step, epoch, _, _), count in zip(rows, per_step, strict=False):
            log_metrics(trainer, {"syncs/count": count}, step=step, epoch=epoch)
        if n:
            steady = [c for (*_, s), c in zip(rows, per_step, strict=False) if s]
            log_metrics(
                trainer,
                {
                    "syncs/per_batch": sum(per_step) / n,
                    "syncs/per_steady_batch": sum(steady) / len(steady) if steady else None,
                },
            )

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.interrupted and self.steps is not None and self.steps.watching:
            # cut short in a watched window (strict's finding, or any error): it counts,
            # with what it saw, so the report agrees with the error that ends the run
            self._count_window(trainer, compat.is_logging_step(trainer))
        self._close()
        merged = SyncSiteTable(LIGHTNING_READS, costs=self.table.costs)
        for rows in gather_objects(trainer, self.table.rows()):
            merged.merge(rows)
        totals = WatchedSums()
        for row in gather_rows(trainer, self.totals.as_list()):
            totals.add(WatchedSums.from_list(row))
        self.table = merged
        folder = run_dir(trainer)  # every rank asks: a broadcast under DDP
        report, lines = syncs_report.end_of_fit(
            merged,
            totals,
            world_size=trainer.world_size,
            batches=self.steps.steps if self.steps else 0,
            optimizer_steps=trainer.global_step - self._first_global_step,
            costs=self._costs,
            budget=self.schedule.budget,
            interval=self.schedule.interval,
            always_watched=self.schedule.first,
            fit_seconds=self._clock.seconds() if self._clock is not None else 0.0,
        )
        self.report = report["summary"]
        publish(trainer, "syncs", report, lines, folder)
        annotations = github_annotations(list(merged.sites.values()))
        if trainer.is_global_zero and in_github_actions() and annotations:
            # On the pull request's diff. A workflow command must start its own line (a
            # progress bar may have left the cursor mid-line).
            print("", *annotations, sep="\n", flush=True)
        if self.strict and not totals.steady_watched and not trainer.interrupted:
            # A gate that checked nothing must not pass: every rank raises (the sums are
            # gathered, so all agree), after the reports are written; a fit cut short (by a
            # sync strict found, a stop) ends with its own error instead.
            raise SyncError(
                "SyncPointDetector(strict=True) checked no step: none of the "
                f"{int(totals.watched / trainer.world_size)} watched batches was steady (the "
                "fit's first, a logging step and the one after it are not); fit more batches, "
                "raise log_every_n_steps, or give first_steps= for strict to check one"
            )


def _or_nan(x: float | None) -> float:
    return float("nan") if x is None else x
