"""Checkpoints written in the background: exactly the state at the save while training goes
on, one write at a time, failures told and not lost, and the loop held only for the
snapshot; kills, a full disk and DDP through the real entry point. (A SIGTERM while a
background write is in flight, then an exact resume:
tests/faults/test_faults.py::test_sigterm_saves_a_checkpoint_that_resumes_exactly.)"""

from __future__ import annotations

import copy
import io
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

import gpu_busy.checkpoint_io as checkpoint_io
from gpu_busy.checkpoint_io import BackgroundCheckpointIO
from gpu_busy.resume.checkpoint_file import SaveFailed
from gpu_busy.resume.snapshot import StateSnapshot
from tests.conftest import DEBUG, DEFAULT, ROOT, run_entry_point
from tests.helpers.trainers import quiet_trainer


class Wide(BoringModel):
    """A few MiB of state, and Adam's moments, which every step changes."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 2))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.1)


class StateAtSave(Callback):
    """The checkpoint's model and optimizer state as they were when each save was made, and
    the state of a module its hyperparameters keep (``KeepsAModule``'s ``inner``)."""

    def __init__(self) -> None:
        self.at: dict[int, dict] = {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        state = {
            "state_dict": checkpoint["state_dict"],
            "optimizer": checkpoint["optimizer_states"],
        }
        inner = checkpoint.get("hyper_parameters", {}).get("inner")
        if inner is not None:
            state["inner"] = inner.state_dict()
        self.at[checkpoint["global_step"]] = copy.deepcopy(state)


def _slow_writes(monkeypatch, seconds: float) -> None:
    real = checkpoint_io.write_atomically

    def slow(path, data):
        time.sleep(seconds)  # training goes on meanwhile
        real(path, data)

    monkeypatch.setattr(checkpoint_io, "write_atomically", slow)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        # on the host: a file loaded to the CPU against the state at its save on the GPU
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _fit_saving_every_2_steps(tmp_path, plugin, steps=10):
    record = StateAtSave()
    saves = ModelCheckpoint(
        tmp_path, "s{step}", every_n_train_steps=2, save_top_k=-1, auto_insert_metric_name=False
    )
    trainer = quiet_trainer(
        max_steps=steps, plugins=[plugin], callbacks=[saves, record], enable_checkpointing=True
    )
    trainer.fit(Wide())
    return record


def _files_hold_the_state_at_their_save(tmp_path, record, weights_only=True) -> list[bool]:
    out = []
    for step, state in sorted(record.at.items()):
        path = tmp_path / f"s{step}.ckpt"
        saved = torch.load(path, map_location="cpu", weights_only=weights_only)
        inner = saved.get("hyper_parameters", {}).get("inner")
        out.append(
            _same(saved["state_dict"], state["state_dict"])
            and _same(saved["optimizer_states"], state["optimizer"])
            and (
                "inner" not in state  # a module kept whole: a copy in the file, exact
                or (isinstance(inner, nn.Module) and _same(inner.state_dict(), state["inner"]))
            )
        )
    return out


def test_a_background_write_holds_exactly_the_state_at_its_save(tmp_path, monkeypatch):
    _slow_writes(monkeypatch, 0.05)  # every write outlasts the next step
    record = _fit_saving_every_2_steps(tmp_path, BackgroundCheckpointIO(background=True))
    assert sorted(record.at) == [2, 4, 6, 8, 10]
    assert _files_hold_the_state_at_their_save(tmp_path, record) == [True] * 5


class RecordingCuda:
    """A stand-in for ``torch.cuda``'s streams and events that writes down what is asked of
    them, in order: the snapshot's CUDA route, travelled on the CPU."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        cuda = self

        class Stream:
            def __init__(self, name):
                self.name = name

            def wait_stream(self, other):
                cuda.calls.append(f"{self.name} waits for {other.name}")

            def wait_event(self, event):
                cuda.calls.append(f"{self.name} waits for the copies' event")

        class Event:
            def record(self, stream):
                cuda.calls.append(f"event recorded on {stream.name}")

            def synchronize(self):
                cuda.calls.append("the writer waits for the event")

        self.compute = Stream("compute")
        self.Stream = lambda device: Stream("side")
        self.Event = Event

    def is_available(self) -> bool:
        return False  # no pinned memory on this machine

    def current_stream(self, device):
        return self.compute

    def stream(self, stream):
        calls = self.calls

        class Context:
            def __enter__(self):
                calls.append(f"copies enqueued on {stream.name}")

            def __exit__(self, *exc):
                calls.append("back to compute")

        return Context()


def test_device_tensors_are_copied_on_a_side_stream_ordered_by_events_not_a_host_wait():
    cuda = RecordingCuda()
    snapshot = StateSnapshot(cuda=cuda, on_device=lambda t: True)
    live = torch.arange(4.0)
    state, ready = snapshot.take({"w": live})
    assert cuda.calls == [
        "side waits for compute",  # the state as the steps so far leave it
        "copies enqueued on side",
        "back to compute",
        "event recorded on side",
        "compute waits for the copies' event",  # the next step cannot overwrite them first
    ]  # and nothing on the loop's thread waited for the device
    ready()
    assert cuda.calls[-1] == "the writer waits for the event"
    assert torch.equal(state["w"], live) and state["w"].data_ptr() != live.data_ptr()


class KeepsAModule(BoringModel):
    """Lightning's CIFAR-10 baseline tutorial keeps a trained module in its hyperparameters
    (``SWAResnet(trained_model, ...)``): the checkpoint pickles that live module whole."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.inner = inner

    def forward(self, x):
        return self.layer(self.inner(x))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.1)


def _storages(obj) -> dict[int, tuple[int, str]]:
    """Every storage ``torch.save`` would write for ``obj``: its data pointer, and its bytes
    and device type."""
    found: dict[int, tuple[int, str]] = {}

    class Spy(pickle.Pickler):
        def persistent_id(self, x):
            if isinstance(x, torch.storage.TypedStorage | torch.UntypedStorage):
                found[x.data_ptr()] = (x.nbytes(), x.device.type)
                return len(found)
            return None

    Spy(io.BytesIO(), protocol=2).dump(obj)
    return found


def _writer_saves(monkeypatch) -> list[dict[int, tuple[int, str]]]:
    """Filled with ``_storages`` of each state the writer thread serialises."""
    written: list[dict[int, tuple[int, str]]] = []
    real_save = torch.save

    def spying_save(obj, f, *args, **kwargs):
        if threading.current_thread().name.startswith("checkpoint-writer"):
            written.append(_storages(obj))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", spying_save)
    return written


def test_a_module_in_the_hyperparameters_is_saved_as_it_was_at_the_save_from_host_copies(
    tmp_path, monkeypatch
):
    # The route a GPU takes, on the CPU: every storage counts as a device one, and the
    # streams and events are the recording stand-in's.
    _slow_writes(monkeypatch, 0.05)  # training goes on while each file is written
    cuda, routed = RecordingCuda(), []
    plugin = BackgroundCheckpointIO(background=True)
    plugin.snapshot = StateSnapshot(
        cuda=cuda, on_device=lambda s: routed.append(s.data_ptr()) or True
    )
    written = _writer_saves(monkeypatch)
    inner = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
    model = KeepsAModule(inner)
    record = StateAtSave()
    saves = ModelCheckpoint(
        tmp_path, "s{step}", every_n_train_steps=2, save_top_k=-1, auto_insert_metric_name=False
    )
    trainer = quiet_trainer(
        max_steps=10, plugins=[plugin], callbacks=[saves, record], enable_checkpointing=True
    )
    trainer.fit(model)
    assert sorted(record.at) == [2, 4, 6, 8, 10] and plugin.in_background is True
    # each file's model, optimizer and kept module as at its save: torch.equal on each tensor
    assert _files_hold_the_state_at_their_save(tmp_path, record, weights_only=False) == [True] * 5
    assert not _same(record.at[2]["inner"], record.at[10]["inner"])  # it trained on between
    # Every live storage the checkpoint reaches, the module's inside the hyperparameters
    # too, took the side-stream copy; the writer thread pickled none of them.
    live = _storages([model.state_dict(), trainer.optimizers[0].state_dict(), dict(model.hparams)])
    assert inner[0].weight.data_ptr() in live and set(live) <= set(routed)
    assert cuda.calls.count("copies enqueued on side") == 5
    # The writer reads the snapshot's host buffers and nothing else: no live storage, and
    # no copy made outside the snapshot (a module deep-copied: on a GPU, a device copy).
    assert len(written) == 5 and not any(w.keys() & live.keys() for w in written)
    assert all(sum(n for n, _ in w.values()) == plugin.snapshot.bytes for w in written)


def test_a_state_that_cannot_be_copied_is_written_in_place_said_once(tmp_path, caplog):
    plugin = BackgroundCheckpointIO(background=True)
    state = {"w": torch.ones(2), "make": lambda: 0}  # pickling refuses a lambda
    for name in ("a.ckpt", "b.ckpt"):
        with pytest.raises(Exception, match="lambda"):
            plugin.save_checkpoint(state, tmp_path / name)  # as torch.save in place says
    assert caplog.text.count("is written in place: its state could not be copied") == 1


def test_after_a_fit_the_plugin_still_says_where_it_wrote(tmp_path):
    # The GPU test read plugin.in_background after fit() and found None: the field was reset
    # at teardown, so the background path's test could never pass.
    plugin = BackgroundCheckpointIO(background=True)
    _fit_saving_every_2_steps(tmp_path, plugin, steps=4)
    assert plugin.in_background is True


def test_one_write_at_a_time_and_the_loop_is_held_only_for_the_snapshot(tmp_path, monkeypatch):
    # Each bound is half the write it tells apart: it holds while the loaded machine keeps
    # this thread waiting under 0.75 s (a 1 MB copy takes milliseconds).
    write_s = 1.5
    _slow_writes(monkeypatch, write_s)
    plugin = BackgroundCheckpointIO(background=True)
    state = {"w": torch.randn(256, 1024), "step": 1}
    before = state["w"].clone()
    plugin.save_checkpoint(state, tmp_path / "a.ckpt")
    assert plugin.blocked_s[0] < write_s / 2  # the snapshot, not the write
    state["w"].add_(1.0)  # training goes on: the file must not see it
    plugin.save_checkpoint({**state, "step": 2}, tmp_path / "b.ckpt")  # waits for a's write
    saved = torch.load(tmp_path / "a.ckpt", weights_only=True)
    assert saved["step"] == 1 and torch.equal(saved["w"], before)
    state["step"] = 2
    assert plugin.blocked_s[1] >= write_s / 2
    started = time.perf_counter()
    plugin.remove_checkpoint(tmp_path / "a.ckpt")  # not the file being written: at once
    assert time.perf_counter() - started < write_s / 2 and not (tmp_path / "a.ckpt").exists()
    plugin.remove_checkpoint(tmp_path / "b.ckpt")  # waits for b's write, then removes it
    assert not (tmp_path / "b.ckpt").exists()
    plugin.save_checkpoint(state, tmp_path / "c.ckpt")
    plugin.teardown()  # the run's end: c's write lands first
    saved = torch.load(tmp_path / "c.ckpt", weights_only=True)
    assert saved["step"] == 2 and torch.equal(saved["w"], before + 1.0)
    assert plugin.snapshot.bytes == 256 * 1024 * 4


def test_by_default_a_cpu_run_writes_in_place_and_a_gpu_state_in_the_background(tmp_path):
    plugin = BackgroundCheckpointIO()
    plugin.save_checkpoint({"w": torch.ones(2)}, tmp_path / "a.ckpt")
    assert plugin.in_background is False and plugin._in_flight is None  # written already
    assert torch.load(tmp_path / "a.ckpt", weights_only=True)["w"].sum() == 2
    assert BackgroundCheckpointIO()._in_background({"w": torch.empty(2, device="meta")}) is False
    if torch.cuda.is_available():
        assert BackgroundCheckpointIO()._in_background({"w": torch.ones(2, device="cuda")})


def test_the_snapshot_reuses_its_buffers_and_copies_what_could_change():
    snapshot = StateSnapshot()
    arr = __import__("numpy").arange(3)
    state = {"t": torch.ones(4), "rng": ("MT19937", arr), "lr": [0.1]}
    first, ready = snapshot.take(state)
    ready()
    buffer = first["t"]
    arr[0] = 99  # a live NumPy array the state holds
    state["lr"][0] = 0.2
    assert first["rng"][1][0] == 0 and first["lr"] == [0.1]
    second, _ = snapshot.take(state)
    assert second["t"].data_ptr() == buffer.data_ptr()  # the same layout: the same buffer
    assert snapshot.bytes == 16
    tied = torch.ones(3)
    third, _ = snapshot.take({"embedding": tied, "head": tied.detach(), "t": torch.ones(4)})
    # one memory, one buffer: as torch.save keeps
    assert third["embedding"].data_ptr() == third["head"].data_ptr() != tied.data_ptr()
    assert snapshot.bytes == 12 + 16


def test_views_objects_and_unusual_tensors_come_out_as_torch_save_keeps_them():
    base, module = torch.arange(12.0), nn.Linear(2, 2)
    state = {
        "base": base, "half": base[6:], "module": module, "weight": module.weight.detach(),
        "conj": torch.tensor([1 + 2j]).conj(), "meta": torch.empty(3, device="meta"),
    }  # fmt: skip
    snapshot = StateSnapshot()
    taken, ready = snapshot.take(state)
    ready()
    # one buffer per storage, shared by its views in containers and inside objects alike
    assert taken["half"].data_ptr() == taken["base"].data_ptr() + 6 * 4
    assert taken["module"].weight.data_ptr() == taken["weight"].data_ptr()
    assert taken["weight"].data_ptr() != module.weight.data_ptr()
    assert snapshot.bytes == 12 * 4 + (4 + 2) * 4 + 8  # base, the module's two, the complex
    base.add_(1.0)
    with torch.no_grad():
        module.weight.add_(1.0)  # training goes on
    assert torch.equal(taken["half"], torch.arange(6.0, 12.0))
    assert torch.equal(taken["module"].weight + 1.0, module.weight.detach())
    assert torch.equal(taken["conj"].resolve_conj(), torch.tensor([1 - 2j]))
    assert taken["meta"].device.type == "meta" and taken["meta"].shape == (3,)


def test_a_failed_background_write_is_told_at_once_and_fails_the_run_at_the_end(
    tmp_path, monkeypatch, caplog
):
    def full_disk(path, data):
        raise SaveFailed(28, f"cannot save {path}: No space left on device")

    monkeypatch.setattr(checkpoint_io, "write_atomically", full_disk)
    plugin = BackgroundCheckpointIO(background=True)
    plugin.save_checkpoint({"w": torch.ones(2)}, tmp_path / "last.ckpt")
    plugin.wait()
    assert "checkpoint write failed in the background" in caplog.text  # when it happened
    with pytest.raises(SaveFailed, match=r"No space left on device.*written in the background"):
        plugin.teardown()


def test_a_later_good_write_of_the_same_file_makes_the_failure_history(tmp_path, monkeypatch):
    real = checkpoint_io.write_atomically
    calls = []

    def full_once(path, data):
        calls.append(path)
        if len(calls) == 1:
            raise SaveFailed(28, f"cannot save {path}: No space left on device")
        real(path, data)

    monkeypatch.setattr(checkpoint_io, "write_atomically", full_once)
    plugin = BackgroundCheckpointIO(background=True)
    plugin.save_checkpoint({"step": 1}, tmp_path / "last.ckpt")
    plugin.save_checkpoint({"step": 2}, tmp_path / "last.ckpt")
    plugin.teardown()  # the file's newest save landed: nothing is missing
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["step"] == 2


# -- through the entry point ---------------------------------------------------------------

# On a CPU the default config writes in place (the writer would take training's cores):
# these runs force the background writer, as a GPU run gets it.
RUN = ["fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.max_epochs=3",
       "--trainer.limit_train_batches=null",
       "--trainer.plugins=gpu_busy.checkpoint_io.BackgroundCheckpointIO",
       "--trainer.plugins.init_args.background=true"]  # fmt: skip


@pytest.mark.slow
def test_kill_9_during_a_background_write_keeps_the_last_good_file_whole(tmp_path):
    # Epoch 0's last.ckpt is written at full speed; then a resumed run's first write is
    # killed halfway (half its bytes staged): the good file stays whole.
    first = run_entry_point(
        [*RUN, "--trainer.max_epochs=1", "--trainer.logger.init_args.name=k"], cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr[-2000:]
    checkpoints = tmp_path / "runs/k/version_0/checkpoints"
    good = (checkpoints / "last.ckpt").read_bytes()
    args = [*RUN, "--trainer.logger.init_args.name=k", "--ckpt_path=last",
            "--trainer.logger.init_args.version=0",
            "--trainer.callbacks+=tests.helpers.faults_probe.SlowCheckpointWrites",
            "--trainer.callbacks.init_args.seconds=60"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    run = subprocess.Popen(
        [sys.executable, "-m", "template.train", *args], cwd=tmp_path, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (tmp_path / "writing").exists():
            time.sleep(0.2)
        assert (tmp_path / "writing").exists(), "no write ever started"
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=30)
    assert (checkpoints / "last.ckpt").read_bytes() == good
    # what --ckpt_path last resumes: the newest complete file, the killed write's stage aside
    from gpu_busy.resume.checkpoint_file import read_checkpoint

    assert read_checkpoint(checkpoints / "last.ckpt")["global_step"] == 16


@pytest.mark.slow
def test_a_full_disk_in_a_background_write_exits_1_in_one_line(tmp_path):
    result = run_entry_point(
        [*RUN, "--trainer.max_epochs=1", "--trainer.logger.init_args.name=full",
         "--trainer.callbacks+=tests.helpers.faults_probe.FullDisk"],
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "No space left on device" in lines[0], result.stderr[-2000:]
    assert "written in the background" in lines[0]
    assert "checkpoint write failed in the background" in result.stderr  # told at once too


@pytest.mark.slow
def test_ddp_on_gloo_rank_zero_writes_in_the_background(tmp_path):
    args = [*RUN, "--trainer.max_epochs=2", "--trainer.accelerator=cpu",
            "--trainer.devices=2", "--trainer.strategy=ddp",
            "--trainer.logger.init_args.name=ddp"]  # fmt: skip
    result = run_entry_point(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    # rank zero alone writes (Lightning's Strategy.save_checkpoint): one snapshot, said once
    assert result.stderr.count("checkpoints are written in the background") == 1
    last = tmp_path / "runs/ddp/version_0/checkpoints/last.ckpt"
    assert torch.load(last, weights_only=True, map_location="cpu")["global_step"] == 16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_background_write_is_exact_and_the_loop_never_waits(tmp_path, monkeypatch):
    from gpu_busy.callbacks import SyncPointDetector

    _slow_writes(monkeypatch, 0.05)
    plugin = BackgroundCheckpointIO()  # the default: a state on the GPU goes to the thread
    written = _writer_saves(monkeypatch)
    record = StateAtSave()
    saves = ModelCheckpoint(
        tmp_path, "s{step}", every_n_train_steps=2, save_top_k=-1, auto_insert_metric_name=False
    )
    detector = SyncPointDetector(first_steps=1000)
    trainer = quiet_trainer(
        accelerator="gpu", max_steps=10, plugins=[plugin],
        callbacks=[saves, record, detector], enable_checkpointing=True,
    )  # fmt: skip
    # a module in the hyperparameters, as Lightning's CIFAR-10 baseline keeps one
    trainer.fit(KeepsAModule(nn.Sequential(nn.Linear(32, 32), nn.Tanh())))
    assert plugin.in_background is True and plugin.snapshot.pinned
    assert _files_hold_the_state_at_their_save(tmp_path, record, weights_only=False) == [True] * 5
    # the writer serialised host memory only: no device-to-host copy in its thread
    devices = [{d for _, d in w.values()} for w in written]
    assert len(devices) == 5 and all(d == {"cpu"} for d in devices), devices
    # the snapshot's copies are enqueued, not waited for: no sync at the saves' sites
    ours = ("checkpoint_io.py", "snapshot.py")
    assert not [s for s in detector.table.sites.values() if s.filename.endswith(ours)]
