"""A battery of bad inputs and faults, as a new user and an unlucky cluster job meet them.

Each case is the real entry point (in process, or as a subprocess where a kill is part of
it) and checks three things: nothing already saved is lost, a mistake is one ``error:``
line with no traceback and a non-zero exit, and what the line says names the fix.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from tests.conftest import DEBUG, DEFAULT, HANG_S, ROOT, cli_main, run_entry_point

main = cli_main()

TINY = ["--config", DEFAULT, "--config", DEBUG, "--trainer.enable_model_summary=false"]


def fit(*args: str) -> int:
    return main(["fit", *TINY, *args])


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def ckpt_dir(root: Path, version: int = 0) -> Path:
    """A run's checkpoint folder, as the entry point names it when run in ``root``."""
    assert Path.cwd() == root
    return Path("runs") / "debug" / f"version_{version}" / "checkpoints"


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


# -- where resumes find their checkpoint ---------------------------------------------------


def test_last_without_a_logger_resumes_the_save_instead_of_overwriting_it(in_tmp, capsys):
    assert fit("--trainer.logger=false", f"--trainer.default_root_dir={in_tmp}") == 0
    last = in_tmp / "checkpoints" / "last.ckpt"
    assert load(last)["global_step"] == 4
    code = fit("--trainer.logger=false", f"--trainer.default_root_dir={in_tmp}",
               "--trainer.max_epochs=2", "--ckpt_path=last")  # fmt: skip
    assert code == 0
    err = capsys.readouterr().err
    assert "training from scratch" not in err and f"resuming from {last}" in err
    assert load(last)["global_step"] == 8 and load(last)["epoch"] == 1


def test_best_on_a_fresh_run_is_one_line(in_tmp, capsys):
    assert fit("--ckpt_path=best") == 2
    assert "--ckpt_path best: no best checkpoint" in one_error_line(capsys)


def test_best_resumes_the_best_scoring_checkpoint_of_earlier_runs(in_tmp, capsys, two_runs_made):
    _first_run(in_tmp, two_runs_made)
    best = next(ckpt_dir(in_tmp).glob("best-*.ckpt"))
    assert main(["validate", *TINY, "--ckpt_path=best"]) == 0
    assert f"evaluating checkpoint {best}" in capsys.readouterr().err


# -- damaged and foreign files -------------------------------------------------------------


@pytest.fixture(scope="module")
def two_runs_made(tmp_path_factory) -> Path:
    """Two versions of the run, fitted once for the module: the older last.ckpt is good, the
    newer one is for a test to damage in its own copy. The first is also what one plain
    ``fit()`` leaves, for the tests that change its files (``_first_run``)."""
    root = tmp_path_factory.mktemp("two_runs")
    before = Path.cwd()
    os.chdir(root)
    try:
        assert fit() == 0
        assert fit("--trainer.max_epochs=2", "--ckpt_path=last") == 0
    finally:
        os.chdir(before)
    return root


def _first_run(root: Path, made: Path) -> Path:
    """What ``fit()`` leaves in ``root``: the module's first run, copied; its last.ckpt."""
    run = ckpt_dir(root, 0).parent
    shutil.copytree(made / run, root / run)
    return run / "checkpoints" / "last.ckpt"


def _two_runs(root: Path, made: Path) -> tuple[Path, Path]:
    shutil.copytree(made / "runs", root / "runs")
    return ckpt_dir(root, 0) / "last.ckpt", ckpt_dir(root, 1) / "last.ckpt"


def _flip_a_byte_in_the_weights(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "not a checkpoint"),
        (lambda p: p.write_bytes(b""), "not a checkpoint"),
        (_flip_a_byte_in_the_weights, "damaged"),
    ],
    ids=["truncated", "empty", "flipped-bytes"],
)
def test_last_skips_a_damaged_newest_save_for_the_newest_good_one(
    in_tmp, capsys, two_runs_made, damage, said
):
    older, newer = _two_runs(in_tmp, two_runs_made)
    damage(newer)
    capsys.readouterr()
    assert fit("--trainer.max_epochs=3", "--ckpt_path=last") == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    skipped = [line for line in err.splitlines() if str(newer) in line and said in line]
    assert skipped, err[-2000:]
    assert f"resuming from {older}" in err
    assert load(ckpt_dir(in_tmp, 2) / "last.ckpt")["epoch"] == 2


def test_an_explicit_damaged_checkpoint_is_one_line(in_tmp, capsys, two_runs_made):
    _, newer = _two_runs(in_tmp, two_runs_made)
    _flip_a_byte_in_the_weights(newer)
    capsys.readouterr()
    assert fit(f"--ckpt_path={newer}") == 2
    line = one_error_line(capsys)
    assert str(newer) in line and "damaged" in line


def test_last_with_only_damaged_saves_is_one_line(in_tmp, capsys, two_runs_made):
    _first_run(in_tmp, two_runs_made)
    last = ckpt_dir(in_tmp) / "last.ckpt"
    _flip_a_byte_in_the_weights(last)
    capsys.readouterr()
    assert fit("--ckpt_path=last") == 2
    line = one_error_line(capsys)
    assert "no usable last.ckpt" in line and str(last) in line


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo planted",))


def test_a_sharded_checkpoint_is_refused_by_name_not_passed_over(in_tmp, capsys):
    """A torch.distributed.checkpoint folder (ModelParallelStrategy's last.ckpt: a file per
    rank, .metadata written last) is named in one line: never "training from scratch"."""
    sharded = ckpt_dir(in_tmp) / "last.ckpt"
    sharded.mkdir(parents=True)
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        (sharded / name).write_bytes(b"shard")
    for asked in ("last", str(sharded)):
        assert fit(f"--ckpt_path={asked}") == 2
        line = one_error_line(capsys)
        assert "is a sharded checkpoint" in line and str(sharded) in line, line
    assert main(["validate", *TINY, "--ckpt_path=best"]) == 2
    assert "skipped: " in one_error_line(capsys)


def test_a_code_carrying_last_ckpt_is_never_loaded(in_tmp, capsys):
    folder = ckpt_dir(in_tmp)
    folder.mkdir(parents=True)
    torch.save({"state_dict": {}, "x": _Payload()}, folder / "last.ckpt")
    assert fit("--ckpt_path=last") == 2
    line = one_error_line(capsys)
    assert "could run code" in line and ("posix.system" in line or "os.system" in line)


def test_a_plain_state_dict_is_one_line_that_says_what_it_is(in_tmp, capsys):
    from template.models import ImageClassifier

    torch.save(ImageClassifier(width=8).state_dict(), in_tmp / "weights.pt")
    assert fit("--ckpt_path=weights.pt") == 2
    line = one_error_line(capsys)
    assert "plain state_dict" in line and "load_state_dict" in line


def test_a_weights_only_checkpoint_cannot_resume_a_fit(in_tmp, capsys, two_runs_made):
    _first_run(in_tmp, two_runs_made)
    trainer_ckpt = load(ckpt_dir(in_tmp) / "last.ckpt")
    weights = {k: trainer_ckpt[k] for k in ("state_dict", "hyper_parameters", "epoch",
                                          "global_step", "pytorch-lightning_version")}  # fmt: skip
    torch.save(weights, in_tmp / "weights.ckpt")
    capsys.readouterr()
    assert fit("--ckpt_path=weights.ckpt") == 2
    line = one_error_line(capsys)
    assert "weights only" in line and "save_weights_only" in line
    # Evaluating from weights is what such a file is for.
    assert main(["validate", *TINY, "--ckpt_path=weights.ckpt"]) == 0


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda c: c["loops"].update(fit_loop={"nonsense": 1}), "its loop state cannot be read"),
        (
            lambda c: c["loops"]["fit_loop"]["epoch_loop.automatic_optimization.optim_progress"][
                "optimizer"
            ]["step"]["total"].update(completed=0),
            "says step 4 but its loop state counts 0",
        ),
    ],
    ids=["unreadable", "other-step"],
)
def test_a_checkpoint_whose_loop_state_disagrees_with_its_step_is_refused(
    in_tmp, capsys, change, said, two_runs_made
):
    _first_run(in_tmp, two_runs_made)
    checkpoint = load(ckpt_dir(in_tmp) / "last.ckpt")
    change(checkpoint)
    torch.save(checkpoint, in_tmp / "odd.ckpt")
    capsys.readouterr()
    assert fit("--trainer.max_epochs=2", "--ckpt_path=odd.ckpt") == 2
    assert said in one_error_line(capsys)


def test_resuming_mid_epoch_with_another_batch_size_is_refused(in_tmp, capsys):
    mid = in_tmp / "mid.ckpt"
    stop = ["--trainer.callbacks+=tests.helpers.faults_probe.SaveAndStop",
            "--trainer.callbacks.init_args.step=2",
            f"--trainer.callbacks.init_args.path={mid}"]  # fmt: skip
    assert fit(*stop) == 0
    capsys.readouterr()
    assert fit("--data.batch_size=16", f"--ckpt_path={mid}") == 2
    line = one_error_line(capsys)
    assert "2 batches into an epoch with data.batch_size=32" in line and "has 16" in line
    assert fit(f"--ckpt_path={mid}") == 0  # with its own batch size it resumes


def test_a_checkpoint_of_another_class_count_is_one_line(
    in_tmp, capsys, image_folder, two_runs_made
):
    _first_run(in_tmp, two_runs_made)  # 10 classes
    last = ckpt_dir(in_tmp) / "last.ckpt"
    capsys.readouterr()
    code = fit("--data.dataset=folder", f"--data.data_dir={image_folder}",
               "--data.batch_size=4", f"--ckpt_path={last}")  # fmt: skip
    assert code == 2
    line = one_error_line(capsys)
    assert "does not fit this model" in line and "[10, " in line and "[3, " in line


def test_a_checkpoints_hyperparameters_that_replace_the_command_line_are_named(
    in_tmp, capsys, two_runs_made
):
    _first_run(in_tmp, two_runs_made)  # width 8 (debug.yaml)
    last = ckpt_dir(in_tmp) / "last.ckpt"
    capsys.readouterr()
    assert fit("--model.width=16", "--trainer.max_epochs=2", f"--ckpt_path={last}") == 0
    err = capsys.readouterr().err
    assert "model.width=8 (this run asked for 16)" in err, err[-2000:]


# -- saves that survive the cluster ----------------------------------------------------------


def _mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                            capture_output=True, text=True)  # fmt: skip
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip() or 'not root'})")


@pytest.fixture
def other_filesystem(tmp_path):
    """A second filesystem (tmpfs), as a cluster's node-local /tmp is to its shared runs."""
    mount = tmp_path / "other-fs"
    _mount_tmpfs(mount, "64m")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


SAVE_AND_DIE = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from gpu_busy.checkpoint_io import AtomicCheckpointIO

    path, step = sys.argv[1], int(sys.argv[2])
    real_fsync = os.fsync

    def die_in_the_middle(fd):
        os.kill(os.getpid(), signal.SIGKILL)

    if step == 2:
        os.fsync = die_in_the_middle  # kill -9 after the bytes are written, before the rename
    state = {"state_dict": {"w": torch.full((256, 1024), float(step))}, "global_step": step}
    AtomicCheckpointIO().save_checkpoint(state, path)
    """
)


@pytest.mark.slow
def test_kill_9_during_a_save_across_filesystems_keeps_the_previous_checkpoint(
    tmp_path, other_filesystem
):
    """Run directory on one filesystem, $TMPDIR on another: the usual cluster layout."""
    runs = tmp_path / "runs"
    path = runs / "checkpoints" / "last.ckpt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(other_filesystem)}
    for step, expected_rc in ((1, 0), (2, -signal.SIGKILL)):
        done = subprocess.run([sys.executable, "-c", SAVE_AND_DIE, str(path), str(step)],
                              env=env, capture_output=True, text=True)  # fmt: skip
        assert done.returncode == expected_rc, done.stderr
    assert load(path)["global_step"] == 1
    assert [p.name for p in path.parent.glob("*.ckpt")] == ["last.ckpt"]


def test_a_save_needs_no_room_in_tmpdir(in_tmp, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(in_tmp / "no-such-dir"))
    assert fit() == 0
    assert load(ckpt_dir(in_tmp) / "last.ckpt")["global_step"] == 4


def test_a_disk_that_fills_mid_run_is_one_line_and_earlier_saves_stay_whole(tmp_path, capsys):
    """The run directory on a small filesystem that fills after the first epoch's saves."""
    runs = tmp_path / "small-fs"
    _mount_tmpfs(runs, "300m")
    try:
        os.chdir(tmp_path)
        code = main(["fit", *TINY, f"--trainer.logger.init_args.save_dir={runs}",
                     "--trainer.max_epochs=2",
                     '--trainer.callbacks+={"class_path": "tests.cli.test_bad_inputs.FillTheDisk", '
                     f'"init_args": {{"folder": "{runs}"}}}}'])  # fmt: skip
        line = one_error_line(capsys)
        assert code != 0 and "cannot save" in line and "No space left" in line, line
        folder = runs / "debug" / "version_0" / "checkpoints"
        for ckpt in folder.glob("*.ckpt"):
            assert ckpt.stat().st_size > 0 and load(ckpt)["epoch"] == 0, ckpt
        assert not [p for p in folder.iterdir() if not p.name.endswith(".ckpt")]
    finally:
        os.chdir(ROOT)
        subprocess.run(["umount", "-l", str(runs)], check=False)


class FillTheDisk(Callback):
    """Fills ``folder``'s filesystem once the first epoch's checkpoints exist, as another
    job on a shared disk would."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 1:
            stat = os.statvfs(self.folder)
            with (self.folder / "filler").open("wb") as f:
                f.write(b"\0" * (stat.f_bavail * stat.f_frsize - 256 * 1024))


# -- bad values, each one line before anything runs ---------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model.lr=-0.1"], "model.lr must be greater than 0"),
        (["--model.lr=0"], "model.lr must be greater than 0"),
        (["--trainer.devices=two"], "trainer.devices"),
        (["--trainer.accelerator=cpu", "--trainer.devices=0"], "trainer.devices"),
        (["--data.image_size=0"], "data.image_size must be at least"),
        (["--data.synthetic_train_size=20", "--data.batch_size=32"], "fewer than one batch"),
        (["--model.momentum=-1"], "model.momentum must be in [0, 1)"),
        (["--model.label_smoothing=2"], "model.label_smoothing must be in [0, 1)"),
        (["--trainer.accumulate_grad_batches=0"], "accumulate_grad_batches must be 1 or more"),
        (["--trainer.strategy=bogus"], "invalid strategy name"),
        (["--data.crop_padding=-1"], "padding must be >= 0"),
        (["--model.class_path=nope.Module"], "no module named nope: a package of your own is"),
        (
            ["--model.class_path=template.models.ImageClasifier"],
            "did you mean template.models.ImageClassifier?",
        ),
        (
            ["--model.lr_batch_size=0"],
            "model.lr_batch_size (the batch model.lr is given for) must be at least 1",
        ),
        (["--trainer.limit_train_batches=0"], "limit_train_batches=0 trains nothing"),
        # a misspelt key is not an abbreviation of another
        (["--trainer.max_epoch=1"], "trainer.max_epoch is not an option; did you mean"),
        (["--trainer.gradient_clip_val=-1"], "gradient_clip_val must be 0 or more"),
        # Lightning's own check, made inside fit once it knows the number of batches
        (["--trainer.val_check_interval=100"], "val_check_interval` (100) must be less"),
        # a value of the wrong type: what the argument takes, from its signature
        (["--trainer.max_epochs=three"], "trainer.max_epochs=three: expected int or null"),
        (["--data.dataset=foo"], "data.dataset=foo: expected one of synthetic, cifar10, folder"),
        (["--data.batch_size=1.5"], "data.batch_size=1.5: expected int"),
        (
            ["--model.class_path=template.data.ImageDataModule"],
            "template.data.ImageDataModule does not correspond to a subclass of LightningModule",
        ),
    ],
)
def test_a_bad_value_is_one_line(in_tmp, capsys, args, expected):
    assert fit(*args) == 2
    assert expected in one_error_line(capsys)
    assert not list(in_tmp.glob("runs/*/*/checkpoints/*.ckpt"))


def _first_weight(c):
    return next(iter(c["state_dict"]))


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda c: c["state_dict"].pop(_first_weight(c)), "tensor(s) of this model missing there"),
        (lambda c: c["state_dict"].update(extra=torch.zeros(1)), "that this model lacks (extra"),
        (lambda c: c.pop("lr_schedulers"), "checkpoint contains only the model"),
        (
            lambda c: c["optimizer_states"][0]["param_groups"].append(
                dict(c["optimizer_states"][0]["param_groups"][0])
            ),
            "different number of parameter groups",
        ),
    ],
    ids=["missing-tensor", "extra-tensor", "no-schedule", "other-param-groups"],
)
def test_a_checkpoint_that_does_not_fit_the_run_is_one_line(
    in_tmp, capsys, change, said, two_runs_made
):
    _first_run(in_tmp, two_runs_made)
    checkpoint = load(ckpt_dir(in_tmp) / "last.ckpt")
    change(checkpoint)
    torch.save(checkpoint, in_tmp / "changed.ckpt")
    capsys.readouterr()
    assert fit("--trainer.max_epochs=2", f"--ckpt_path={in_tmp / 'changed.ckpt'}") == 2
    line = one_error_line(capsys)
    assert said in line and "changed.ckpt" in line, line


def test_a_corrupt_image_stops_the_run_naming_the_file(in_tmp, capsys, image_folder):
    bad = image_folder / "train" / "cats" / "0.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    code = fit("--data.dataset=folder", f"--data.data_dir={image_folder}", "--data.batch_size=4",
               "--data.num_workers=1")  # fmt: skip
    assert code == 2
    line = one_error_line(capsys)
    assert str(bad) in line and "remove or replace it" in line


def test_a_decompression_bomb_stops_the_run_naming_the_file(in_tmp, capsys, image_folder):
    from PIL import Image

    bomb = image_folder / "train" / "dogs" / "0.png"
    # Over twice PIL's pixel limit (a small file: one colour compresses to almost nothing).
    side = int((2 * Image.MAX_IMAGE_PIXELS) ** 0.5) + 1
    Image.new("1", (side, side)).save(bomb)
    code = fit("--data.dataset=folder", f"--data.data_dir={image_folder}", "--data.batch_size=4",
               "--data.num_workers=0")  # fmt: skip
    assert code == 2
    line = one_error_line(capsys)
    assert str(bomb) in line and "too large to decode safely" in line


def test_max_epochs_minus_one_trains_until_stopped(in_tmp):
    """Lightning's "no limit": the LR schedule must not divide by an infinite step count."""
    # Stopped after a counted number of steps, not a time: a loaded machine runs fewer.
    assert fit("--trainer.max_epochs=-1",
               "--trainer.callbacks+=tests.helpers.faults_probe.SaveAndStop",
               "--trainer.callbacks.init_args.step=6",
               "--trainer.callbacks.init_args.path=stopped.ckpt") == 0  # fmt: skip
    last = load(in_tmp / "stopped.ckpt")
    assert last["global_step"] == 6
    assert all(
        torch.isfinite(t).all() for t in last["state_dict"].values() if t.is_floating_point()
    )


def test_a_yaml_error_names_its_file(in_tmp, capsys):
    (in_tmp / "mine.yaml").write_text("model:\n  width: [16\n")
    assert fit("--config", "mine.yaml") == 2
    assert "mine.yaml" in one_error_line(capsys)


@pytest.mark.slow
def test_ctrl_c_twice_is_our_line(tmp_path):
    """The first Ctrl+C asks for a save at the step's end; a second one stops at once."""
    result = run_entry_point(
        ["fit", *TINY, "--trainer.max_epochs=2",
         "--trainer.callbacks+=tests.helpers.faults_probe.SignalAt",
         "--trainer.callbacks.init_args.step=2", "--trainer.callbacks.init_args.signal=SIGINT",
         "--trainer.callbacks.init_args.times=2"],
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 128 + signal.SIGINT, result.stderr[-3000:]
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith(("error:", "stopped:"))]
    assert len(lines) == 1 and lines[0].startswith("stopped: Ctrl+C twice"), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr


# -- no open doors -------------------------------------------------------------------------


def test_cifar10_reader_refuses_a_planted_pickle(tmp_path, capsys):
    from tests.conftest import write_cifar10

    root = tmp_path / "cifar"
    write_cifar10(root)
    marker = tmp_path / "ran"
    with (root / "cifar-10-batches-py" / "data_batch_3").open("wb") as f:
        pickle.dump({b"data": _Touch(str(marker)), b"labels": []}, f)
    os.chdir(tmp_path)
    try:
        code = main(["fit", *TINY, "--data.dataset=cifar10", f"--data.data_dir={root}",
                     "--data.download=false"])  # fmt: skip
    finally:
        os.chdir(ROOT)
    assert not marker.exists(), "unpickling the planted file ran its code"
    assert code == 2
    line = one_error_line(capsys)
    assert "data_batch_3" in line and "not plain data" in line


class _Touch:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_a_yaml_alias_bomb_is_refused_before_it_is_expanded(in_tmp, capsys):
    # Nine levels of ten aliases each: a billion strings once expanded (3 GiB and more).
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for level in range(1, 9):
        lines.append(f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * 10)}]")
    (in_tmp / "bomb.yaml").write_text("\n".join(lines) + "\n")
    assert fit("--config", "bomb.yaml") == 2
    assert "expands to more than 100,000 values through YAML aliases" in one_error_line(capsys)


@pytest.mark.parametrize(
    ("yaml_text", "key", "meant"),
    [
        ("trainer:\n  max_epoch: 1\n", "trainer.max_epoch", "trainer.max_epochs"),
        ("model:\n  init_args:\n    widht: 8\n", "model.widht", "model.width"),
        ("data:\n  batch_sise: 8\n", "data.batch_sise", "data.batch_size"),
        ("modle:\n  lr: 0.1\n", "modle.lr", "model.lr"),
    ],
)
def test_a_misspelt_key_names_its_file_and_the_key_meant(in_tmp, capsys, yaml_text, key, meant):
    (in_tmp / "mine.yaml").write_text(yaml_text)
    assert fit("--config", "mine.yaml") == 2
    said = f"error: mine.yaml: {key} is not an option; did you mean {meant}?"
    assert one_error_line(capsys).startswith(said)


@pytest.mark.parametrize("text", ["just some text\n", "- a\n- list\n", "42\n"])
def test_a_config_file_that_holds_no_settings_is_named(in_tmp, capsys, text):
    (in_tmp / "mine.yaml").write_text(text)
    assert fit("--config", "mine.yaml") == 2
    line = one_error_line(capsys)
    assert line.startswith("error: mine.yaml holds ") and "not settings" in line


def test_a_misspelt_key_on_the_command_line_says_so(in_tmp, capsys):
    assert fit("--model.widht=8") == 2
    line = one_error_line(capsys)
    assert line.startswith("error: the command line: model.widht is not an option; did you mean")


def test_a_class_help_is_help_not_a_misspelt_key(in_tmp, capsys):
    # Keys are checked before jsonargparse parses: its per-class --<group>.help is no key.
    with pytest.raises(SystemExit):
        fit("--model.help", "template.models.ImageClassifier")
    out = capsys.readouterr()
    assert "--model.width" in out.out and "error:" not in out.err


def test_a_broken_config_file_is_refused_before_torch_is_imported(tmp_path):
    """The one-line error does not wait for the heavy imports (about 10 s here)."""
    (tmp_path / "mine.yaml").write_text("model:\n  width: [16\n")
    for config in ("mine.yaml", "nope.yaml"):
        result = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "template.train", "fit", "--config", config],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
            text=True, timeout=HANG_S,
        )  # fmt: skip
        assert result.returncode == 2
        errors = [x for x in result.stderr.splitlines() if x.startswith("error:")]
        assert len(errors) == 1 and config in errors[0], result.stderr[-2000:]
        imported = [x.split("|")[-1].strip() for x in result.stderr.splitlines() if "|" in x]
        assert "yaml" in imported and "torch" not in imported and "lightning" not in imported


def test_a_config_file_is_parsed_once_and_again_when_it_changes(tmp_path):
    from gpu_busy.config_files import read_settings

    mine = tmp_path / "mine.yaml"
    mine.write_text("model:\n  width: 8\n")
    first = read_settings(mine)
    assert first == {"model": {"width": 8}} and read_settings(mine) is first
    mine.write_text("model:\n  width: 16\n  depth: 34\n")
    assert read_settings(mine) == {"model": {"width": 16, "depth": 34}}


def test_lightnings_refusal_of_more_gpus_than_exist_is_reworded_whole(monkeypatch):
    # On a GPU machine with one GPU, devices=4 is refused by Lightning's device parser
    # (lightning/fabric/utilities/device_parser.py, _sanitize_gpu_ids) in two lines.
    from lightning.fabric.accelerators import cuda
    from lightning.fabric.utilities.device_parser import _sanitize_gpu_ids

    from gpu_busy.cli.error_lines import devices_line, raised_choosing_devices

    monkeypatch.setattr(cuda, "_get_all_visible_cuda_devices", lambda: [0])
    with pytest.raises(Exception) as refused:
        _sanitize_gpu_ids([0, 1, 2, 3], include_cuda=True)
    assert raised_choosing_devices(refused.value)
    line = devices_line(refused.value, "gpu", 4)
    said = "You requested gpu: [0, 1, 2, 3] But your machine only has: [0] (this machine has "
    assert line.startswith(f"trainer.accelerator=gpu trainer.devices=4: {said}")
    assert "\n" not in line


def test_two_checkpoint_callbacks_writing_one_file_are_refused_before_either_writes(in_tmp, capsys):
    (in_tmp / "two.yaml").write_text(
        textwrap.dedent("""\
        trainer:
          callbacks:
            - class_path: lightning.pytorch.callbacks.ModelCheckpoint
              init_args: {monitor: val/acc, mode: max, save_last: true}
            - class_path: lightning.pytorch.callbacks.ModelCheckpoint
              init_args: {filename: last, enable_version_counter: false}
        """)
    )
    # with its version counter off the second writes over the first's file, not beside it
    assert fit("--config", "two.yaml") == 2
    folder = ckpt_dir(in_tmp)
    assert one_error_line(capsys) == (
        "error: ModelCheckpoint(save_last=True) and ModelCheckpoint(filename='last') both "
        f"write last.ckpt in {folder}: give one of them another dirpath or filename, or drop one"
    )
    assert not folder.exists() or not any(folder.iterdir())
