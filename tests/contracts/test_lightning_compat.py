"""Pins the Lightning internals the template touches (all in gpu_busy/lightning_compat/).

If one of these fails after a Lightning upgrade, the attribute was renamed or removed:
update gpu_busy/lightning_compat/, not the callers.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars

from gpu_busy import lightning_compat as compat
from gpu_busy.lightning_compat import is_logging_step
from tests.helpers.lightning_privates import reaches
from tests.helpers.trainers import quiet_trainer


def test_logger_connector_should_update_logs_exists():
    trainer = quiet_trainer()
    assert hasattr(trainer, "_logger_connector"), "Trainer._logger_connector was renamed"
    assert hasattr(type(trainer._logger_connector), "should_update_logs"), (
        "_LoggerConnector.should_update_logs was renamed"
    )
    assert isinstance(is_logging_step(trainer), bool)


def test_is_logging_step_matches_lightnings_logging_steps(tmp_path):
    seen = []

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(is_logging_step(trainer))

    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = quiet_trainer(
        max_steps=9, log_every_n_steps=3, callbacks=[Probe()], default_root_dir=tmp_path
    )
    trainer.fit(BoringModel())
    # Lightning writes on steps 3, 6, 9 (1-based): the 3rd, 6th and 9th batches.
    assert seen == [False, False, True] * 3


def test_is_logging_step_answers_as_lightning_at_every_hook_once_computed_per_step(tmp_path):
    """The answer is kept for the step: it must still follow a stop asked mid-step (which
    makes Lightning log that step) and validation's own steps."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    asked = []

    def ask(trainer, where):
        lightnings = bool(trainer._logger_connector.should_update_logs)
        for _ in range(2):  # the second answer comes from the step's cache
            asked.append((where, is_logging_step(trainer), lightnings))

    class StopAtFive(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ask(trainer, "before the stop")
            if trainer.global_step == 5:
                trainer.should_stop = True

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            ask(trainer, "start")

        def on_train_batch_end(self, trainer, *args):
            ask(trainer, "end")

        def on_validation_batch_end(self, trainer, *args):
            ask(trainer, "validation")

    trainer = quiet_trainer(
        max_steps=9, log_every_n_steps=4, val_check_interval=2, limit_val_batches=2,
        callbacks=[StopAtFive(), Probe()], default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(BoringModel())
    assert all(ours == lightnings for _, ours, lightnings in asked), asked
    # the stop at step 5 made that step a logging step for the hooks after it
    ends = [ours for where, ours, _ in asked if where == "end"][::2]
    assert ends == [False, False, False, True, True]
    assert any(where == "validation" for where, _, _ in asked)


def test_fetcher_and_loader_internals_exist_in_every_loop(tmp_path):
    """loop._data_fetcher (.length/.fetched/.prefetch_batches) and loop._combined_loader."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from gpu_busy.lightning_compat import fetcher_counts, logger_step

    seen = {}

    def check(name, loop):
        assert hasattr(loop, "_data_fetcher"), f"{type(loop).__name__}._data_fetcher was renamed"
        assert hasattr(loop, "_combined_loader"), f"{type(loop).__name__}._combined_loader renamed"
        length, fetched, lookahead = fetcher_counts(loop)
        assert length == 4 and fetched >= 1 and lookahead == 0, "fetcher .length/.fetched changed"
        seen[name] = True

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            check("train", trainer.fit_loop)
            assert isinstance(logger_step(trainer), int)

        def on_validation_batch_start(self, trainer, *args):
            check("val", trainer.fit_loop.epoch_loop.val_loop)

        def on_test_batch_start(self, trainer, *args):
            check("test", trainer.test_loop)

        def on_predict_batch_start(self, trainer, *args):
            check("predict", trainer.predict_loop)

    trainer = quiet_trainer(
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=4,
        limit_test_batches=4,
        limit_predict_batches=4,
        callbacks=[Probe()],
        default_root_dir=tmp_path,
    )
    model = BoringModel()
    trainer.fit(model)
    trainer.test(model)
    trainer.predict(model)
    assert set(seen) == {"train", "val", "test", "predict"}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_batches_left_to_read_stop_where_max_steps_does(tmp_path, accumulate):
    """Asked where the prefetcher asks (the loop's first read): the loop then reads
    exactly that many batches (fetcher counts, batch_progress.current.ready)."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from gpu_busy.batch_routing import batches_left_to_read, route_batches, unroute

    asked, taken = [], []

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            def count(items):
                asked.append(batches_left_to_read(trainer.fit_loop, training=True))
                for item in items:
                    taken.append(item)
                    yield item

            self.loader = route_batches(trainer.fit_loop, count)

        def on_train_end(self, trainer, pl_module):
            unroute(self.loader)

    quiet_trainer(
        max_steps=3, limit_train_batches=10, accumulate_grad_batches=accumulate,
        callbacks=[Probe()], default_root_dir=tmp_path,
    ).fit(BoringModel())  # fmt: skip
    assert asked == [len(taken)] == [3 * accumulate]


def test_prefetch_batches_is_the_unsized_fetchers_lookahead():
    from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher

    assert _PrefetchDataFetcher().prefetch_batches == 1, "_PrefetchDataFetcher.prefetch_batches"


def test_combined_loader_can_be_routed_and_restored():
    """The loop's fetcher calls next() on the CombinedLoader itself (iter() returns it)."""
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    from gpu_busy.batch_routing import _is_routed, route_batches, unroute

    loader = CombinedLoader([[10, 11, 12]], "max_size_cycle")
    assert iter(loader) is loader, "iter(CombinedLoader) no longer returns the loader"

    class Loop:
        _combined_loader = loader

    made = []

    def make_iterator(items):
        made.append(True)
        return ((batch, idx, dl) for batch, idx, dl in items)

    assert route_batches(Loop, make_iterator) is loader and _is_routed(loader)
    iter(loader)
    assert [b for b, _, _ in loader] == [[10], [11], [12]] and made == [True]
    iter(loader)  # a new pass makes a new iterator
    next(loader)
    assert made == [True, True]
    unroute(loader)
    assert type(loader) is CombinedLoader and not _is_routed(loader)
    iter(loader)
    assert next(loader)[0] == [10]


def test_routing_layers_stack_by_position_and_leave_one_at_a_time():
    """The idle monitor's timing layer sits below the prefetcher's, next to the DataLoader."""
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    from gpu_busy.batch_routing import _is_routed, route_batches, unroute

    loader = CombinedLoader([[1, 2]], "max_size_cycle")

    class Loop:
        _combined_loader = loader

    seen = []

    def layer(tag):
        def make_iterator(items):
            for item in items:
                seen.append(tag)
                yield item

        return make_iterator

    route_batches(Loop, layer("outer"), layer="prefetch", position=1)
    route_batches(Loop, layer("inner"), layer="idle", position=0)
    iter(loader)
    next(loader)
    assert seen == ["inner", "outer"]  # the lower position is closer to the DataLoader
    unroute(loader, layer="prefetch")
    assert _is_routed(loader)
    seen.clear()
    iter(loader)
    next(loader)
    assert seen == ["inner"]
    unroute(loader, layer="idle")
    assert type(loader) is CombinedLoader


def test_training_loop_broadcasts_sigterm_through_one_method():
    """StopOnSignal replaces _TrainingEpochLoop._broadcast_sigterm_tensor per instance."""

    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    assert hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor"), (
        "_TrainingEpochLoop._broadcast_sigterm_tensor was renamed"
    )
    # looked up on the instance at every step, so an instance attribute overrides it
    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)
    assert ".item()" in inspect.getsource(_TrainingEpochLoop._broadcast_sigterm_tensor)


def test_epoch_position_counts_the_batch_just_trained_and_rolls_over_at_epoch_end(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel

    from gpu_busy.lightning_compat import epoch_position

    seen = []

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            seen.append(("batch", epoch_position(trainer)))

        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                seen.append(("val", epoch_position(trainer)))

    trainer = quiet_trainer(
        max_epochs=2,
        limit_train_batches=3,
        limit_val_batches=1,
        callbacks=[Probe()],
        default_root_dir=tmp_path,
    )
    trainer.fit(BoringModel())
    assert seen == [
        ("batch", (0, 1)), ("batch", (0, 2)), ("batch", (1, 0)), ("val", (1, 0)),
        ("batch", (1, 1)), ("batch", (1, 2)), ("batch", (2, 0)), ("val", (2, 0)),
    ]  # fmt: skip


def test_lightnings_launcher_keeps_its_children_in_procs():
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher,
    )

    launcher = _SubprocessScriptLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)
    assert hasattr(launcher, "procs"), "_SubprocessScriptLauncher.procs was renamed"


def test_lightnings_launcher_starts_the_other_ranks_with_the_command_we_give(monkeypatch):
    """Lightning's DDP launcher builds the other ranks' command with _basic_subprocess_cmd,
    looked up in its own module when it starts them: the launcher's ranks run through
    ``python -m gpu_busy run`` while ``children_run_through`` holds, and bare after."""
    import subprocess

    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher,
    )

    started: list[list[str]] = []

    class Recorded:
        def __init__(self, command, **kwargs):
            started.append(list(command))

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    monkeypatch.setattr(sys, "argv", ["/abs/train.py", "--lr", "3"])
    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE"):
        # the launcher sets them in os.environ: set, then deleted, each is put back as it
        # was after the test (a LOCAL_RANK left behind tells later fits they were launched)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    ours = [sys.executable, "-m", "gpu_busy", "run", "/abs/train.py"]
    undo = compat.children_run_through(ours)
    try:
        launcher = _SubprocessScriptLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)
        launcher._call_children_scripts()
    finally:
        undo()
    assert started == [[*ours, "--lr", "3"]]
    from lightning.fabric.strategies.launchers import subprocess_script as fabric_launcher
    from lightning.pytorch.strategies.launchers import subprocess_script as launcher_module

    assert launcher_module._basic_subprocess_cmd is fabric_launcher._basic_subprocess_cmd


def test_lightnings_child_observer_can_be_deferred_and_restored():
    import os
    import time

    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    class Child:  # a rank that failed, as Popen reports it
        pid, returncode = 12345, 1

        def poll(self):
            return self.returncode

        def send_signal(self, sig):
            # Raised in the observer's thread before it reaches os.kill(this process): a
            # deferral that failed ends that thread, not the test run.
            raise AssertionError("the deferred observer signalled a child")

    child = Child()
    observer = _ChildProcessObserver(os.getpid(), [child], sleep_period=0.2)
    observer.start()
    undo = compat.defer_child_observer()  # before its first look (0.2 s)
    time.sleep(0.6)  # un-deferred, it would have SIGKILLed this test process by now
    assert observer.is_alive()
    child.returncode = 0  # all ranks done: its own check ends the thread without a kill
    undo()
    observer.join(timeout=2)
    assert not observer.is_alive() and "_run" not in observer.__dict__


def test_the_lightning_functions_named_in_sync_fixes_exist():
    # The report recognises Lightning's own reads by these functions in a sync's chain.
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import (
        _LoggerConnector,
    )

    from gpu_busy.syncs.rules import LIGHTNING_READS

    owners = {
        "_broadcast_sigterm_tensor": _TrainingEpochLoop,
        "in on_batch_end": _LoggerConnector,
        "progress_bar_metrics": _LoggerConnector,
        "update_train_step_metrics": _LoggerConnector,
        "callback_metrics": pl.Trainer,
    }
    assert [marker for marker, _ in LIGHTNING_READS] == list(owners)
    for marker, owner in owners.items():
        assert hasattr(owner, marker.removeprefix("in ")), marker


def test_lightnings_teardown_puts_back_the_handler_we_keep(tmp_path):
    """Trainer._signal_connector._original_handlers: what Lightning re-registers in its
    teardown, before on_fit_end. StopOnSignal's handler must still be there then."""
    import signal

    from lightning.pytorch.demos.boring_classes import BoringModel

    from gpu_busy.callbacks import StopOnSignal

    seen = {}

    class Probe(pl.Callback):
        def on_fit_end(self, trainer, pl_module):
            seen["on_fit_end"] = signal.getsignal(signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    stop = StopOnSignal()
    trainer = quiet_trainer(max_steps=2, default_root_dir=tmp_path, callbacks=[stop, Probe()])
    connector = trainer._signal_connector
    assert hasattr(connector, "_original_handlers") or hasattr(type(connector), "teardown")
    trainer.fit(BoringModel())
    assert isinstance(connector._original_handlers, dict), "_original_handlers was renamed"
    assert seen["on_fit_end"] == stop.request._handle, "Lightning's handler came back first"
    assert signal.getsignal(signal.SIGTERM) == before, "the original handler was not restored"


def test_prog_bar_conversions_are_found_at_the_line_that_logged_them(tmp_path):
    """LightningModule._current_fx_name, ResultCollection.metrics' ``result_metric`` and
    trainer.call._call_callback_hooks: a detector watching all but the callbacks' hooks sees
    where Lightning converts a prog_bar metric after a step, at the user's line."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from gpu_busy.syncs.detector import SyncDetector

    logged = compat.LoggedAt()
    found, in_hooks = [], []

    class Logs(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log_dict({"pb": out["loss"]}, prog_bar=True)  # through log_dict
            return out

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.detector = detector = SyncDetector("cpu", origins=(logged.origin,))
            self.done = False
            self.undo = compat.around_callback_hooks(
                lambda: detector.active and detector.__exit__(None, None, None),
                lambda: self.done or detector.active or detector.__enter__(),
            )

        def on_train_batch_end(self, trainer, *args):
            in_hooks.append(self.detector.active)

        def on_train_end(self, trainer, pl_module):
            self.undo()
            self.done = True  # the hooks' end, still to come, must not watch again
            found.extend(
                e
                for e in self.detector.take()
                if e.filename == __file__ and any("result.py" in c for c in e.chain)
            )

    probe = Probe()
    trainer = quiet_trainer(max_steps=2, callbacks=[probe], default_root_dir=tmp_path)
    with logged.install():
        assert pl.LightningModule.log is not BoringModel.__dict__.get("log")
        trainer.fit(Logs())
    assert pl.LightningModule.log.__qualname__ == "LightningModule.log"  # restored
    assert in_hooks == [False, False]  # the callbacks' hooks were not watched
    assert not probe.detector.active
    from lightning.pytorch.trainer import call

    assert call._call_callback_hooks.__qualname__ == "_call_callback_hooks"  # restored
    (fx_name,) = logged.lines
    assert fx_name == ("training_step", "pb")
    assert [e.op for e in found] == ["Tensor.item()"] * 2, found
    assert all(e.filename == __file__ and "log_dict" in e.code for e in found)
    assert all(e.function == "training_step" for e in found)
    # who asked: the loop, past the Trainer and its connectors (logger_connector.py)
    assert all(e.via.startswith("lightning/pytorch/loops/training_epoch_loop.py") for e in found)


def test_lightning_moves_to_the_cpu_as_to_cuda_until_undone():
    """Pins apply_func._BLOCKING_DEVICE_TYPES: move_data_to_device passes non_blocking=True
    to a device type not in it (CUDA), and blocking to the CPU."""
    import torch
    from lightning.fabric.utilities.apply_func import move_data_to_device
    from torch.overrides import TorchFunctionMode

    class Moves(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.non_blocking: list[bool] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.to:
                self.non_blocking.append(bool((kwargs or {}).get("non_blocking")))
            return func(*args, **(kwargs or {}))

    def moved() -> list[bool]:
        with Moves() as spy:
            move_data_to_device({"x": torch.ones(2)}, torch.device("cpu"))
        return spy.non_blocking

    assert moved() == [False]
    undo = compat.moves_to_the_cpu_as_to_cuda()
    try:
        assert moved() == [True]
    finally:
        undo()
    assert moved() == [False]


def test_lightning_skips_a_callback_hook_that_is_none(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel

    calls = []

    class EndsOnly(compat.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            calls.append("end")

    class AlsoBackward(EndsOnly):  # a subclass's own override is called, and its super()
        def on_before_backward(self, trainer, pl_module, loss):
            calls.append("backward")
            super().on_before_backward(trainer, pl_module, loss)

    ends_only, also = EndsOnly(), AlsoBackward()
    assert ends_only.on_before_backward is None and ends_only.on_train_batch_start is None
    assert callable(also.on_before_backward)
    trainer = quiet_trainer(max_steps=3, callbacks=[ends_only, also], default_root_dir=tmp_path)
    trainer.fit(BoringModel())
    assert (
        calls == ["end", "backward", "end"] * 3 or sorted(calls) == ["backward"] * 3 + ["end"] * 6
    )
    compat.skip_hooks(ends_only, ["on_train_batch_end"])
    calls.clear()
    trainer = quiet_trainer(max_steps=2, callbacks=[ends_only], default_root_dir=tmp_path)
    trainer.fit(BoringModel())
    assert calls == []  # None on the instance: Lightning's dispatch never called it
    compat.skip_hooks(ends_only, ["on_train_batch_end"], skip=False)
    assert callable(ends_only.on_train_batch_end)


def test_metrics_at_the_last_step_end_are_lightnings_stored_dict(tmp_path):
    import torch
    from lightning.pytorch.demos.boring_classes import BoringModel

    seen = {}

    class Logs(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("a", out["loss"])
            self.log("b", out["loss"], prog_bar=True)
            return out

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2:
                seen.update(compat.metrics_at_last_step_end(trainer))

    trainer = quiet_trainer(max_steps=3, callbacks=[Probe()], default_root_dir=tmp_path)
    trainer.fit(Logs())
    assert isinstance(seen["a"], torch.Tensor) and isinstance(seen["b"], torch.Tensor)


def test_lightning_converts_prog_bar_values_and_logged_values_where_the_patch_expects():
    """Pins prog_bar_numbers_when_read: result.py converts each prog_bar value through its
    module's convert_tensors_to_scalars in _ResultCollection.metrics, logger_connector.py
    converts what it hands the loggers through its own in log_metrics, and
    _LoggerConnector.progress_bar_metrics is a property over _progress_bar_metrics."""

    from lightning.pytorch.trainer.connectors.logger_connector import logger_connector, result

    metrics = inspect.getsource(result._ResultCollection.metrics)
    assert 'metrics["pbar"][forked_name] = convert_tensors_to_scalars(value)' in metrics
    assert inspect.getsource(result).count("convert_tensors_to_scalars(") == 1
    log_metrics = inspect.getsource(logger_connector._LoggerConnector.log_metrics)
    assert "scalar_metrics = convert_tensors_to_scalars(metrics)" in log_metrics
    assert inspect.getsource(logger_connector).count("convert_tensors_to_scalars(") == 1
    read = logger_connector._LoggerConnector.__dict__["progress_bar_metrics"]
    assert isinstance(read, property)
    assert "self._progress_bar_metrics" in inspect.getsource(read.fget)


def test_prog_bar_values_are_converted_when_read_and_put_back(tmp_path):
    import torch
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.trainer.connectors.logger_connector import result

    seen = {}

    class Logs(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("b", out["loss"], prog_bar=True)
            self.log("i", torch.tensor(batch_idx), prog_bar=True)
            return out

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2:
                stored = trainer._logger_connector._progress_bar_metrics
                seen["stored"] = {k: type(v) for k, v in stored.items()}
                seen["read"] = dict(trainer.progress_bar_metrics)

    from lightning.pytorch.trainer.connectors.logger_connector import logger_connector

    def patched():
        return (result.convert_tensors_to_scalars, logger_connector.convert_tensors_to_scalars,
                logger_connector._LoggerConnector.__dict__["progress_bar_metrics"])  # fmt: skip

    before = patched()
    trainer = quiet_trainer(max_steps=3, callbacks=[Probe()], default_root_dir=tmp_path)
    undo = compat.prog_bar_numbers_when_read(trainer)
    try:
        trainer.fit(Logs())
    finally:
        undo()
    assert seen["stored"] == {"b": torch.Tensor, "i": torch.Tensor}  # kept, not converted
    assert isinstance(seen["read"]["b"], float) and seen["read"]["i"] == 1  # read: numbers
    assert result.convert_tensors_to_scalars is convert_tensors_to_scalars  # put back
    assert patched() == before  # all three
    assert not any(isinstance(v, torch.Tensor) for v in trainer.progress_bar_metrics.values())


def test_model_checkpoint_looks_for_its_monitor_in_save_topk_checkpoint():

    from lightning.pytorch.callbacks import ModelCheckpoint

    params = list(inspect.signature(ModelCheckpoint._save_topk_checkpoint).parameters)
    assert params == ["self", "trainer", "monitor_candidates"]
    source = inspect.getsource(ModelCheckpoint._save_topk_checkpoint)
    assert "self.monitor not in monitor_candidates" in source


def test_a_model_checkpoint_without_step_saves_does_nothing_at_a_batch_end(tmp_path):
    """The step clock skips ModelCheckpoint's on_train_batch_end where neither
    every_n_train_steps nor train_time_interval is set: it must be a no-op there."""
    from datetime import timedelta

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    looked, changed = [], []
    ckpt._monitor_candidates = lambda trainer: looked.append(trainer.global_step) or {}
    original = ckpt.on_train_batch_end

    def watched(*args):
        before = dict(vars(ckpt))
        original(*args)
        changed.append(vars(ckpt) != before)

    ckpt.on_train_batch_end = watched
    trainer = quiet_trainer(
        max_steps=4, callbacks=[ckpt], enable_checkpointing=True, default_root_dir=tmp_path
    )
    trainer.fit(BoringModel())
    assert changed == [False] * 4 and looked == [4]  # the one save: the fit's end
    assert "on_train_batch_end" in compat.skip_empty_hooks(ModelCheckpoint(dirpath=tmp_path))
    for saves_by_step in (
        ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2),
        ModelCheckpoint(dirpath=tmp_path, train_time_interval=timedelta(seconds=1)),
    ):
        assert "on_train_batch_end" not in compat.skip_empty_hooks(saves_by_step)


def test_without_a_chosen_profiler_the_hooks_run_unprofiled_and_a_chosen_one_still_records(
    tmp_path,
):
    """``lighter_dispatch`` replaces the default profiler's per-hook context, a generator
    around ``start`` and ``stop`` that do nothing, for the fit; a profiler a user chose keeps
    recording every hook."""

    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.profilers import PassThroughProfiler, Profiler, SimpleProfiler

    from gpu_busy.callbacks import IdleTimeMonitor

    # What makes the replacement equivalent: the base's context calls start and stop,
    # which the default profiler leaves empty.
    assert PassThroughProfiler.profile is Profiler.profile
    assert "self.start(action_name)" in inspect.getsource(Profiler.profile)
    for name in ("start", "stop"):
        body = inspect.getsource(getattr(PassThroughProfiler, name)).strip().splitlines()[-1]
        assert body.strip() == "pass", name

    seen = {}

    class Look(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen["context"] = type(trainer.profiler.profile("x")).__name__

    trainer = quiet_trainer(max_steps=2, callbacks=[Look(), IdleTimeMonitor(warmup_steps=0)])
    trainer.fit(BoringModel())
    assert seen["context"] == "nullcontext"
    assert "profile" not in vars(trainer.profiler)  # given back after the fit

    simple = SimpleProfiler(dirpath=tmp_path, filename="p")
    trainer = quiet_trainer(
        max_steps=2, profiler=simple, callbacks=[Look(), IdleTimeMonitor(warmup_steps=0)]
    )
    trainer.fit(BoringModel())
    assert seen["context"] != "nullcontext"
    assert any("Look.on_train_batch_end" in action for action in simple.recorded_durations)


def _module_of(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_nothing_outside_lightning_compat_reaches_a_private_of_lightning():
    """The one door: every private attribute, method or file of Lightning that gpu_busy
    touches is touched in gpu_busy/lightning_compat/ (tests/helpers/lightning_privates.py
    says what counts)."""
    root = Path(compat.__file__).parents[2]
    paths = [
        p for p in sorted((root / "gpu_busy").rglob("*.py")) if "lightning_compat" not in p.parts
    ]
    assert reaches(paths, lambda p: _module_of(p, root)) == []


def test_the_door_check_finds_each_way_in_and_leaves_a_classs_own_privates(tmp_path, monkeypatch):
    (tmp_path / "reaching.py").write_text(
        "import os\n"
        "from lightning.pytorch.callbacks import ModelCheckpoint\n"
        "from lightning.pytorch.strategies import ModelParallelStrategy\n"
        "from lightning.pytorch.trainer.call import _call_callback_hooks\n\n"
        "class Sharded(ModelParallelStrategy):\n"
        "    def setup_environment(self):\n"
        "        self._data_parallel_size = 2\n"
        "        self._ranks = None\n\n"
        "class Best(ModelCheckpoint):\n"
        "    def _save_topk_checkpoint(self, trainer, candidates):\n"
        "        pass\n\n"
        "def read(trainer):\n"
        "    where = os.path.join('lightning', 'pytorch')\n"
        "    return trainer._logger_connector, where, 'checkpoint_connector.py'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    found = [
        line.split(": ", 1)[1] for line in reaches([tmp_path / "reaching.py"], lambda p: "reaching")
    ]
    assert sorted(found) == sorted([
        "Sharded sets or overrides _data_parallel_size",
        "Best sets or overrides _save_topk_checkpoint",
        "._logger_connector",
        "imports _call_callback_hooks",
        "joins a path into Lightning's files",
        "names Lightning's file 'checkpoint_connector.py'",
    ]), found  # fmt: skip


def test_a_sharded_strategy_builds_its_mesh_from_the_data_parallel_size_set_on_it():
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(data_parallel_size="auto", tensor_parallel_size=1)
    assert "_data_parallel_size" in vars(strategy), "renamed: set_data_parallel_size"
    compat.set_data_parallel_size(strategy, 4)
    assert strategy._data_parallel_size == 4
    # setup_environment reads it to build the mesh (resolving only "auto")
    source = inspect.getsource(ModelParallelStrategy.setup_environment)
    assert 'if self._data_parallel_size == "auto"' in source
    assert "self._data_parallel_size, self._tensor_parallel_size" in source


def test_every_top_k_save_of_model_checkpoint_passes_the_gate(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    source = inspect.getsource(ModelCheckpoint)
    assert "def _save_topk_checkpoint(self, trainer" in source
    asked = []

    class Never(compat.SaveGatedCheckpoint):
        def save_due(self, trainer, monitor_candidates):
            asked.append(trainer.global_step)
            return False

    gate = Never(dirpath=tmp_path, monitor="train_loss", save_top_k=2, save_last=True)
    trainer = quiet_trainer(
        max_epochs=2, limit_train_batches=2, callbacks=[gate], enable_checkpointing=True
    )
    trainer.fit(BoringModel())
    assert asked == [2, 4]  # each epoch's save asked, none written but last.ckpt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_lightnings_files_are_where_the_error_lines_look_for_them():
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    from gpu_busy.lightning_compat import files

    assert compat.is_lightning_file(pl.Trainer.fit.__code__.co_filename)
    assert not compat.is_lightning_file(__file__)
    assert compat.chooses_devices(inspect.getsourcefile(_AcceleratorConnector))
    assert all(Path(p).exists() for p in files._DEVICE_CHOICE), files._DEVICE_CHOICE
    restore = _CheckpointConnector.restore_training_state.__code__
    assert compat.restores_a_checkpoint(restore.co_filename, restore.co_name)


def test_model_checkpoints_version_counter_is_what_decides_an_overwrite():
    """``never_overwrites`` reads ModelCheckpoint's private flag, which the two methods that
    name a file consult before writing over one that exists."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    assert compat.never_overwrites(ModelCheckpoint())
    assert not compat.never_overwrites(ModelCheckpoint(enable_version_counter=False))
    for method in (ModelCheckpoint._save_last_checkpoint,
                   ModelCheckpoint._get_metric_interpolated_filepath_name):  # fmt: skip
        assert "if self._enable_version_counter:" in inspect.getsource(method)


def test_a_callback_stand_in_without_the_hooks_on_its_class_is_left_as_it_is():
    """Lightning's tests put ``Mock()`` callbacks in the list: no hook is found on the
    class, none is skipped, nothing raises."""
    from unittest.mock import Mock

    assert compat.skip_empty_hooks(Mock()) == []
