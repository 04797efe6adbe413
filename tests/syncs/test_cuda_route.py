"""The CUDA paths on the CPU: CUDA's sync warning as CUDA raises it (tests/helpers/cuda_standin.py).

Each test here fails on code that would count a sync twice, arm the debug mode where it
is not read, or lose a warning on a GPU; tests/gpu/test_gpu.py holds their GPU twins.
"""

from __future__ import annotations

import inspect
import warnings
from collections import Counter

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_busy import cuda_sync_warnings
from gpu_busy.syncs import SyncError, detect_syncs
from gpu_busy.syncs.rules import ATEN_RULES
from tests.helpers import cuda_standin
from tests.helpers.sync_cases import CASES, Tensors
from tests.helpers.trainers import quiet_trainer

# Device memory in the simulation: made before any detector is entered.
x = torch.arange(6.0) - 2
mask = x > 0


@pytest.fixture
def standin():
    with cuda_standin.install() as s:
        yield s


def _line(marker: str) -> int:
    source, start = inspect.getsourcelines(inspect.currentframe().f_back.f_code)
    return start + next(i for i, text in enumerate(source) if marker in text)


# -- the stand-in travels CUDA's route ----------------------------------------------------


def test_the_standins_warning_comes_from_cpp_after_the_dispatch_mode_returned(standin):
    order = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            order.append(f"returned {func.overloadpacket.__name__}")
            return out

    def heard(message, *args, **kwargs):
        order.append("warning")

    standin.set("warn")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = heard
        with Spy():
            x.sum().item()
    standin.set(0)
    assert order == ["returned sum", "returned _local_scalar_dense", "warning"]
    standin.set("error")
    with pytest.raises(RuntimeError, match=cuda_standin.MESSAGE):
        x.nonzero()
    standin.set(0)
    assert x.nonzero().shape == (5, 1) and x.sum().item() == 3.0  # the real results


# -- 1. one event per sync -------------------------------------------------------------------


def test_an_op_with_an_aten_rule_is_one_event(standin):
    with detect_syncs(device_type="cpu") as rec:
        torch.nonzero(x)  # sync: nonzero
        torch.where(x > 0)  # sync: where
        x.argwhere()  # sync: argwhere
    assert standin.kernel_syncs == 3, "the stand-in did not warn"
    assert [e.lineno for e in rec.events] == [
        _line(f"# sync: {name}") for name in ("nonzero", "where", "argwhere")
    ], [str(e) for e in rec.events]
    assert all(e.aten == "aten.nonzero.default" for e in rec.events)


def test_a_python_rule_that_owns_its_call_is_one_event(standin):
    with detect_syncs(device_type="cpu") as rec:
        x.sum().item()  # sync: item
        x[mask]  # sync: mask
        if x.sum() > 0:  # sync: bool
            pass
    assert [e.lineno for e in rec.events] == [
        _line(f"# sync: {n}") for n in ("item", "mask", "bool")
    ]


def test_a_sync_missing_from_the_table_is_one_event_named_by_the_call(standin, monkeypatch):
    monkeypatch.delitem(ATEN_RULES, torch.ops.aten.nonzero)  # pretend it is unknown
    with detect_syncs(device_type="cpu") as rec:
        x.nonzero()  # the debug mode's warning names this line
        torch.where(mask)  # and this one
    assert standin.kernel_syncs == 2
    first, second = rec.events
    assert first.op == "Tensor.nonzero (CUDA sync debug)", first
    assert second.op == "torch.where (CUDA sync debug)", second
    assert first.lineno == _line("x.nonzero()  # the") and second.lineno == first.lineno + 1
    assert first.filename == __file__


def test_a_call_that_waits_many_times_inside_is_one_event(standin):
    """repr of a device tensor reads back a dozen values (14 warnings on a GPU machine),
    all heard when repr returns: one print, one event."""
    with detect_syncs(device_type="cpu") as rec:
        repr(x)  # sync: repr
    assert standin.kernel_syncs > 1, "the stand-in should warn once per read inside repr"
    assert [e.lineno for e in rec.events] == [_line("# sync: repr")], [str(e) for e in rec.events]


SYNCING = [c for c in CASES if c.syncs]


@pytest.mark.parametrize("case", SYNCING, ids=[c.name for c in SYNCING])
def test_every_syncing_case_through_cudas_route_is_as_many_events_as_the_case_says(standin, case):
    """The case list, with CUDA's warnings raised the way CUDA raises them: as often as
    the call reads back, heard when it returns. A GPU machine found seven calls that
    warn more than once (repr 14 times, isin 3); each is still one event. (The sync-free
    cases stay with the simulation's test: some CPU kernels read back where CUDA's do
    not, one_hot's bounds check for one, and the stand-in warns at every CPU read.)"""
    t = Tensors("cpu")
    with detect_syncs(device_type="cpu") as rec:
        rec.memory.mark_host(*t.host())
        standin.on_device = rec.memory.on_device
        case.run(t)
    assert rec.internal_errors == 0
    assert len(rec.events) == case.syncs, [str(e) for e in rec.events]


def test_stream_synchronize_is_one_event(standin):
    stream = cuda_standin.StandInStream()
    with detect_syncs(device_type="cpu") as rec:
        stream.synchronize()  # sync: stream
    assert standin.kernel_syncs == 1
    (event,) = rec.events
    assert event.op == "Stream.synchronize()" and event.lineno == _line("# sync: stream")


def test_a_sync_in_backward_is_one_event_at_the_forward_line(standin):
    w = torch.arange(6.0, requires_grad=True)
    with detect_syncs(device_type="cpu") as rec:
        y = w[mask]  # sync: forward (and its backward)
        y.sum().backward()
    assert standin.kernel_syncs == 2, "forward and backward each index with the mask"
    assert [(e.phase, e.lineno) for e in rec.events] == [
        ("forward", _line("# sync: forward")),
        ("backward", _line("# sync: forward")),
    ], [str(e) for e in rec.events]


def test_a_backward_sync_only_cuda_saw_is_one_event(standin, monkeypatch):
    monkeypatch.delitem(ATEN_RULES, torch.ops.aten.nonzero)

    class SyncsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, grad):
            torch.ops.aten.nonzero(grad)  # C++ route: no Python binding, no handler
            return grad * 2

    w = torch.ones(3, requires_grad=True)
    with detect_syncs(device_type="cpu") as rec:
        SyncsInBackward.apply(w).sum().backward()  # sync: backward
    assert standin.kernel_syncs == 1
    (event,) = rec.events
    assert event.op == "Tensor.backward (CUDA sync debug)", event
    assert event.lineno == _line("# sync: backward")


def test_strict_raises_at_the_line_once(standin):
    with pytest.raises(SyncError, match="nonzero"), detect_syncs("cpu", strict=True) as rec:
        torch.nonzero(x)
    assert len(rec.events) == 1


class _OneReadPerStep(BoringModel):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.losses.append(float(out["loss"]))  # one sync per step
        torch.nonzero(batch[0, :4])  # and one more, seen by an aten rule
        return out


def test_a_fit_with_two_syncs_per_step_reports_two_per_watched_step(standin, tmp_path):
    from gpu_busy.callbacks import SyncPointDetector

    model = _OneReadPerStep()
    model.losses = []
    detector = SyncPointDetector(first_steps=6, log_stats=False)
    trainer = quiet_trainer(
        max_epochs=2,
        limit_train_batches=6,
        limit_val_batches=2,
        callbacks=[detector],
        default_root_dir=tmp_path,
    )
    trainer.fit(model)
    totals = detector.totals
    assert totals.watched >= 6 and standin.kernel_syncs >= 2 * totals.watched
    assert totals.syncs == 2 * totals.watched, detector.report
    sites = {s.op for s in detector.table.sites.values()}
    assert not any("CUDA sync debug" in op or op == "a CUDA sync" for op in sites), sites
    assert standin.mode == 0, "the debug mode was left armed"


# -- 2. armed only where it is read ------------------------------------------------------------


def test_the_listener_gives_barriers_the_users_mode(standin, monkeypatch):
    seen = []
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: seen.append(standin.mode))
    with cuda_sync_warnings.cuda_sync_warnings(lambda: None):
        torch.distributed.barrier()
        assert standin.mode == 1
    torch.distributed.barrier()
    assert seen == [0, 0] and standin.mode == 0
    standin.set("error")  # the user's own mode is theirs, barriers included
    with cuda_sync_warnings.cuda_sync_warnings(lambda: None):
        torch.distributed.barrier()
    assert seen[-1] == 2 and standin.mode == 2


class _ModeSpy(pl.Callback):
    def __init__(self, standin) -> None:
        self.standin = standin
        self.modes: dict[str, set[int]] = {}

    def _see(self, where: str) -> None:
        self.modes.setdefault(where, set()).add(self.standin.mode)

    def on_validation_batch_start(self, *args, **kwargs):
        self._see("validation")

    def on_train_epoch_end(self, *args):
        self._see("epoch end")

    def on_save_checkpoint(self, *args):
        self._see("checkpoint")


class _SpyInStep(BoringModel):
    def training_step(self, batch, batch_idx):
        self.spy._see("training step")
        return super().training_step(batch, batch_idx)


def test_a_fit_arms_the_debug_mode_only_in_the_windows_that_read_it(standin, tmp_path):
    from gpu_busy.callbacks import IdleTimeMonitor, SyncPointDetector

    spy = _ModeSpy(standin)
    model = _SpyInStep()
    model.spy = spy
    trainer = quiet_trainer(
        max_epochs=2,
        limit_train_batches=4,
        limit_val_batches=2,
        default_root_dir=tmp_path,
        enable_checkpointing=True,  # the epoch's save: not a window the marks read
        callbacks=[
            IdleTimeMonitor(warmup_steps=0, picture=False, log_stats=False),
            SyncPointDetector(first_steps=2, log_stats=False),
            spy,
        ],
    )
    trainer.fit(model)
    assert spy.modes["training step"] == {1}, spy.modes  # the idle monitor's marks
    assert spy.modes["validation"] == {0}, spy.modes
    assert spy.modes["epoch end"] == {0}, spy.modes
    assert spy.modes["checkpoint"] == {0}, spy.modes
    assert standin.mode == 0 and standin.sets[-1] == 0


def test_a_warning_heard_past_every_call_is_named_beyond_the_warning_route():
    """On a GPU machine a checkpoint save's copy warned after every call the layers saw had
    returned, with no user frame before Lightning's loop: the event was named at the
    hook's own ``on_sync()`` line. It is named at the library line that asked."""
    import os

    from gpu_busy import cuda_sync_warnings as hook_module
    from gpu_busy.syncs import attribution

    site = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    loop_file = os.path.join(site, "lightning", "pytorch", "trainer", "a_loop.py")
    scope: dict = {"event_here": attribution.event_here}
    exec(compile("def hear():\n    return event_here('a CUDA sync', 'between steps', None)\n",
                 os.path.abspath(hook_module.__file__), "exec"), scope)  # fmt: skip
    exec(compile("def loop():\n    return hear()\n", loop_file, "exec"), scope)
    event = scope["loop"]()
    assert event.filename == loop_file and event.lineno == 2, event


def test_a_warning_issued_by_a_binding_the_layers_do_not_see_is_the_recorded_sync(standin):
    """``torch.save`` copies each CUDA storage with ``Storage.copy_``, a C++ binding: the
    dispatch layer records the copy, and CUDA's warning comes when that binding returns,
    after the copy's call ended. A GPU machine counted every checkpoint copy twice (90
    recorded, 90 heard) until the late warning paid the recorded call's debt."""
    # DisableTorchFunction: a binding the function layer cannot see, as Storage.copy_
    with detect_syncs(device_type="cpu") as rec, torch._C.DisableTorchFunction():
        x.sum().item()  # sync: unseen binding
    assert standin.kernel_syncs == 1
    assert [e.lineno for e in rec.events] == [_line("# sync: unseen binding")], [
        str(e) for e in rec.events
    ]


_MODE_FRAMES = ("__torch_function__", "__torch_dispatch__")


def test_the_default_callbacks_sync_never_in_a_steady_step_and_once_at_most_at_logging(
    standin, tmp_path
):
    """CUDA's debug mode armed over a whole fit, as on the GPU machine: each sync is
    blamed on the innermost frame outside torch and Lightning that asked for it. Frames in
    gpu_busy/ may ask once per logging step (never in a steady one: the loggers' values in
    one copy), whatever the module logs with prog_bar=True, and Lightning's loop never."""
    import sys
    from pathlib import Path

    from lightning.pytorch.loggers import CSVLogger

    import gpu_busy
    from bench.host import default_config_parts
    from gpu_busy import batch_routing
    from gpu_busy.lightning_compat import is_logging_step
    from template.data import ImageDataModule
    from tests.helpers.bound_runs import ProgBarImageClassifier

    ours = str(Path(gpu_busy.__file__).parent)
    # The routed loader's iter() and next() are Lightning's and the DataLoader's own calls
    # (the DataLoader's seed is a host tensor the stand-in cannot tell from device memory).
    routed = batch_routing._routed_class(object)
    passing = {routed.__iter__.__code__, routed.__next__.__code__,
               batch_routing._own_items.__code__}  # fmt: skip
    libraries = (str(Path(torch.__file__).parent), str(Path(pl.__file__).parent.parent))
    where = {"step": None}
    heard: list[tuple[object, str]] = []  # (the step's kind or None, the frame's file)

    class StepKinds(pl.Callback):
        """First in the list: the step starts; last: its hooks have run."""

        def on_train_batch_start(self, trainer, *args) -> None:
            if self is first:
                where["step"] = "logging" if is_logging_step(trainer) else "steady"

        def on_train_batch_end(self, trainer, *args) -> None:
            if self is last:  # Lightning's work after the hooks, the next fetch
                where["step"] = f"after {where['step']}"

        def on_validation_start(self, trainer, pl_module) -> None:
            where["step"] = None  # validation and saves: the loop waits there anyway

        on_train_epoch_end = on_validation_start

    first, last = StepKinds(), StepKinds()

    def on_sync() -> None:
        frame, stack = sys._getframe(1), []
        while frame is not None and not frame.f_code.co_filename.endswith("warnings.py"):
            frame = frame.f_back  # out of the warning's route, to the call that synced
        while frame is not None:
            stack.append(frame)
            frame = frame.f_back
        # A dispatch mode (the sync detector's) runs an op for its caller: what is inside
        # its frame is the op's route; the caller is outside it.
        modes = [i for i, f in enumerate(stack) if f.f_code.co_name in _MODE_FRAMES]
        outside = stack[modes[-1] + 1 :] if modes else stack
        asker = next(
            (f.f_code.co_filename for f in outside
             if not f.f_code.co_filename.startswith(libraries)
             and not f.f_code.co_filename.endswith("warnings.py")
             and f.f_code not in passing),
            "?",
        )  # fmt: skip
        heard.append((where["step"], asker))

    callbacks, plugins = default_config_parts()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        limit_train_batches=12,
        limit_val_batches=2,
        log_every_n_steps=4,
        num_sanity_val_steps=0,
        logger=CSVLogger(tmp_path),
        enable_model_summary=False,
        callbacks=[first, *callbacks, last],
        plugins=plugins,
    )
    data = ImageDataModule(
        batch_size=8, synthetic_train_size=96, synthetic_val_size=16, num_workers=0
    )
    with cuda_sync_warnings.cuda_sync_warnings(on_sync):
        trainer.fit(ProgBarImageClassifier(width=8), data)

    steady = [f for kind, f in heard if kind in ("steady", "after steady") and f.startswith(ours)]
    logging = [
        f for kind, f in heard if kind in ("logging", "after logging") and f.startswith(ours)
    ]
    assert not steady, f"gpu_busy synced in steady steps at {sorted(set(steady))}"
    logging_steps = trainer.global_step // 4
    assert len(logging) <= logging_steps, f"at {logging_steps} logging steps: {Counter(logging)}"
    # Lightning's prog_bar conversions after each step, asked by the loop (so by this file,
    # which called fit): none under the template's bar
    loop = [f for kind, f in heard if kind == "after steady" and f == __file__]
    assert not loop, Counter(loop)


def test_arming_cudas_debug_mode_prints_no_prototype_warning(monkeypatch):
    def set_sync_debug_mode(mode):  # what PyTorch's binding issues at its first arming
        warnings.warn(
            "Synchronization debug mode is a prototype feature and does not yet detect all "
            "synchronizing operations",
            UserWarning,
            stacklevel=2,
        )

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_sync_debug_mode)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        cuda_sync_warnings.CUDA.set("warn")
        warnings.warn("another warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in shown] == ["another warning"]
