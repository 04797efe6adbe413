"""``python -m gpu_busy run``: scripts of others, unchanged, with the default set.

``lightning_examples/`` holds Lightning's own example scripts exactly as Lightning ships them
(examples/pytorch at commit 7f0c3436 of Lightning-AI/pytorch-lightning, Apache-2.0): the
MNIST they would download is written beside them, small and synthetic, where their own code
looks for it. ``scripts/user_train.py`` is a plain script as users write them.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import ADDED, HANG_S, ROOT
from tests.conftest import launcher_env as _env
from tests.conftest import run_launcher as launch

HERE = Path(__file__).parent
USER = HERE / "scripts" / "user_train.py"


def _mnist(root: Path) -> None:
    """What Lightning's demo MNIST loads (``<root>/MNIST/complete/*.pt``), drawn: 60,000
    training images, since the examples split them 55,000/5,000."""
    folder = root / "MNIST" / "complete"
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for name, n in (("training.pt", 60_000), ("test.pt", 10_000)):
        images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g)
        torch.save((images, torch.randint(0, 10, (n,), generator=g)), folder / name)


def _example(tmp_path: Path, name: str) -> Path:
    """The example copied unchanged to <tmp>/examples/basics/, so that its DATASETS_PATH
    (two folders up) is <tmp>/Datasets."""
    folder = tmp_path / "examples" / "basics"
    folder.mkdir(parents=True)
    shutil.copy(HERE / "lightning_examples" / name, folder / name)
    return folder / name


SHORT = ["--trainer.accelerator=cpu", "--trainer.max_epochs=1", "--trainer.limit_train_batches=8",
         "--trainer.limit_val_batches=2", "--trainer.limit_test_batches=2",
         "--trainer.limit_predict_batches=2", "--trainer.log_every_n_steps=2"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", ["autoencoder.py", "backbone_image_classifier.py"])
def test_lightnings_cli_examples_run_unchanged_with_the_summary(tmp_path, name):
    script = _example(tmp_path, name)
    _mnist(tmp_path / "Datasets")
    # Lightning's switch for its own tests: its demo MNIST, read from DATASETS_PATH
    result = launch([str(script), *SHORT], cwd=tmp_path, PL_USE_MOCKED_MNIST="1")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert out.count(ADDED) == 1, out[-3000:]  # one Trainer: its fit, test and predict
    assert "fit done" in out and "sync points:" in out, out[-3000:]
    reports = list((tmp_path / "lightning_logs").glob("version_*/run.json"))
    assert reports, sorted(p.name for p in tmp_path.rglob("*.json"))


@pytest.mark.slow
def test_a_script_that_raises_keeps_its_traceback_and_exit_1(tmp_path):
    """The traceback Python prints without the launcher, from the script's own frame (a
    script that runs: tests/template/test_any_script.py)."""
    raised = launch([str(USER)], tmp_path, USER_TRAIN_RAISE="1")
    assert raised.returncode == 1, raised.stderr[-3000:]
    lines = raised.stderr.strip().splitlines()
    assert lines[-1] == "ValueError: the user's own error at step 2", lines[-5:]
    frames = [line for line in lines if line.startswith('  File "')]
    assert str(USER) in frames[0] and "runpy" not in raised.stderr, raised.stderr[-2000:]


@pytest.mark.slow
def test_a_script_keeps_its_exit_code_its_sync_is_named_at_its_line_and_strict_fails_there(
    tmp_path,
):
    ran = launch([str(USER), "--exit", "3"], cwd=tmp_path)
    assert ran.returncode == 3, ran.stderr[-3000:]
    assert ran.stdout.splitlines()[-1].startswith("user script done at step 12: {'acc'")
    assert "user_train.py:36  [training_step]  Tensor.item()" in ran.stderr, ran.stderr[-3000:]
    strict = launch(["--strict", "-m", "tests.launcher.scripts.user_train"], cwd=tmp_path)
    assert strict.returncode == 1, strict.stderr[-3000:]
    line = strict.stderr.strip().splitlines()[-1]
    assert line.startswith("error: strict sync check failed") and "user_train.py:36" in line
    # the summary agrees with the error: the batch it ended counts, with that one sync
    summary = next(x for x in strict.stderr.splitlines() if "sync points:" in x)
    assert "1 of 2 training batches watched" in summary and "1.00 syncs/batch" in summary


def test_a_trainers_own_progress_bar_and_checkpoint_stay_and_the_first_line_says_so(
    tmp_path, caplog
):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar

    from gpu_busy import callbacks as cb
    from gpu_busy.launcher import attach

    undo = attach([sys.executable, "-m", "gpu_busy", "run", "x.py"])
    try:
        bar, saves = TQDMProgressBar(), ModelCheckpoint(filename="mine")
        trainer = pl.Trainer(callbacks=[bar, saves], default_root_dir=tmp_path, logger=False)
    finally:
        undo()
    kinds = [type(c) for c in trainer.callbacks]
    assert bar in trainer.callbacks and saves in trainer.callbacks
    assert cb.LoggingStepProgressBar not in kinds and cb.BestCheckpoint not in kinds
    assert cb.SyncPointDetector in kinds and cb.RunSummary in kinds
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith(ADDED))
    assert "kept the Trainer's own ModelCheckpoint, TQDMProgressBar" in line, line
    plain = pl.Trainer(default_root_dir=tmp_path, logger=False)  # undone: a plain Trainer again
    assert not any(isinstance(c, cb.RunSummary) for c in plain.callbacks)


def test_the_default_set_pickles_for_ddp_spawn_before_a_fit_and_after_it(tmp_path):
    """ddp_spawn pickles the Trainer at each fit, validate or test: after a fit too, when
    what each callback built for it (clocks, a copier, a detector) is made again."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    import gpu_busy

    def trainer(**kwargs):
        return pl.Trainer(accelerator="cpu", logger=False, max_steps=3, log_every_n_steps=1,
                          default_root_dir=tmp_path, **kwargs)  # fmt: skip

    first = trainer(**gpu_busy.defaults(monitor="val/acc"))
    for fitted in (False, True):
        if fitted:
            first.fit(BoringModel())
        callbacks = pickle.loads(pickle.dumps(first.callbacks))
        io = pickle.loads(pickle.dumps(first.strategy.checkpoint_io))
    again = trainer(callbacks=callbacks, plugins=[io])
    again.fit(BoringModel())
    assert again.global_step == 3
    pickle.dumps(again)  # the whole Trainer, after its fit, as deep-copyable as without us
    assert copy.deepcopy(again).global_step == 3


def test_the_gpu_busy_command_is_the_launcher():
    from importlib.metadata import entry_points

    (command,) = entry_points(group="console_scripts", name="gpu-busy")
    assert command.value == "gpu_busy.launcher:command"


def test_the_launchers_own_mistakes_are_one_line_and_exit_2(capsys):
    from gpu_busy.launcher import main

    for argv, says in ((["run"], "no script given"), (["run", "nothere.py"], "no such file"),
                       (["run", "--mode", "up", "x.py"], "give max or min"),
                       (["run", "--bogus", "x.py"], "not an option of gpu_busy run"),
                       ([], "say what to run")):  # fmt: skip
        assert main(argv) == 2
        error = capsys.readouterr().err.splitlines()
        assert error[0].startswith("error: ") and says in error[0], error


# -- every rank alike ------------------------------------------------------------------


def _callbacks_by_rank(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.glob("callbacks.rank*.txt"))}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_two_ranks_through_lightnings_launchers_have_the_same_set_and_one_report(
    tmp_path, strategy
):
    ran = launch([str(USER), "--strategy", strategy, "--devices", "2", "--record", str(tmp_path)],
                 cwd=tmp_path)  # fmt: skip
    out = ran.stderr
    assert ran.returncode == 0, out[-3000:]
    ranks = _callbacks_by_rank(tmp_path)
    assert len(ranks) == 2 and len(set(ranks.values())) == 1, ranks
    assert "SyncPointDetector" in ranks["callbacks.rank1.txt"]
    assert out.count("fit done") == 1 and out.count(ADDED) == 1, out[-3000:]
    assert "over 2 process(es)" in out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchrun_starts_every_rank_through_the_launcher(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(_free_port()), "-m", "gpu_busy", "run", str(USER),
               "--strategy", "ddp", "--devices", "2", "--record", str(tmp_path)]  # fmt: skip
    ran = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=HANG_S)  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    ranks = _callbacks_by_rank(tmp_path)
    assert len(ranks) == 2 and len(set(ranks.values())) == 1, ranks
    assert ran.stderr.count("fit done") == 1, ran.stderr[-3000:]


@pytest.mark.slow
def test_a_rank_without_the_set_ends_the_run_at_set_up_in_one_line_not_a_hang(tmp_path):
    """Rank 0 through the launcher, rank 1 bare, as two nodes' launchers could start them."""
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
              "NODE_RANK": "0", "GPU_BUSY_RANK_WAIT": "5"}  # fmt: skip
    args = [str(USER), "--strategy", "ddp", "--devices", "2"]
    started = time.monotonic()
    procs = [
        subprocess.Popen([sys.executable, *(["-m", "gpu_busy", "run"] if rank == 0 else []),
                          *args], cwd=tmp_path, env=_env(**common, LOCAL_RANK=str(rank)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]  # fmt: skip
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    elapsed = time.monotonic() - started
    assert procs[0].returncode == 1, outs[0][1][-3000:]
    lines = [line for line in outs[0][1].splitlines() if line.startswith("error:")]
    assert lines == [
        "error: rank 1 of 2 has no gpu_busy callbacks (started without python -m gpu_busy "
        "run?): every rank needs the same set, or none does; stopped at set-up"
    ], outs[0][1][-3000:]
    assert procs[1].returncode != 0 and elapsed < 100, (elapsed, outs[1][1][-2000:])


DOMAIN = HERE / "scripts" / "domain_templates.py"


def _values(args: list[str], out: Path, launched: bool, **env: str) -> dict:
    """``domain_templates.py`` plain or under the launcher: its logged values."""
    prefix = [sys.executable, "-m", "gpu_busy", "run"] if launched else [sys.executable]
    command = [*prefix, str(DOMAIN), *args, str(out)]
    ran = subprocess.run(command, cwd=out.parent, env=_env(**env), capture_output=True,
                         text=True, timeout=HANG_S)  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stderr.count(ADDED) == int(launched), ran.stderr[-3000:]
    assert ran.stderr.count("fit done") == int(launched), ran.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("example", ["gan", "ppo"])
def test_lightnings_gan_and_ppo_train_under_the_launcher_with_a_plain_runs_values(
    tmp_path, example
):
    """Both take ``training_step(self, batch)`` under manual optimisation, whose toggled
    ``requires_grad`` makes the FLOP count count again at every logging step: its wrapper
    made Lightning pass ``batch_idx`` (TypeError) until it kept the step's signature."""
    plain = _values([example], tmp_path / "plain.json", launched=False)
    measured = _values([example], tmp_path / "measured.json", launched=True)
    assert measured["step"] == plain["step"] == 8
    # PPO's loader writes avg_* on the module as it yields: equal only where the prefetcher
    # reads it no further ahead than Lightning does
    assert measured == plain


@pytest.mark.slow
def test_lightnings_gan_trains_through_the_entry_point_named_on_the_command_line(tmp_path):
    command = [sys.executable, "-m", "template.train", "fit",
               "--config", str(ROOT / "configs" / "default.yaml"),
               "--config", str(ROOT / "configs" / "cpu.yaml"),
               "--model=generative_adversarial_net.GAN", "--model.img_shape=[3,32,32]",
               "--trainer.max_steps=8", "--trainer.log_every_n_steps=1",
               # its example_input_array is a latent vector, which the template's data
               # hooks refuse as images; its epoch end logs images to TensorBoard
               "--trainer.enable_model_summary=false", "--trainer.logger=false"]  # fmt: skip
    examples = str(HERE / "lightning_examples")
    env = _env(PYTHONPATH=os.pathsep.join([str(ROOT), examples]))
    ran = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=HANG_S)  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "fit done" in ran.stderr and "8 steps" in ran.stderr, ran.stderr[-3000:]


# -- both package names, and scripts with nothing to attach to -------------------------


def test_both_names_are_one_package_and_a_pytorch_lightning_trainer_takes_the_set(tmp_path):
    """This process imported gpu_busy (conftest): pytorch_lightning is lightning.pytorch,
    its logger too, and a file of its distribution alone still imports."""
    import logging

    import lightning.pytorch as lp
    import pytorch_lightning
    import pytorch_lightning.__about__
    from lightning.pytorch.demos.boring_classes import BoringModel

    from gpu_busy import defaults
    from gpu_busy.callbacks import LoggingStepProgressBar, SyncPointDetector

    assert (
        pytorch_lightning.Trainer is lp.Trainer and pytorch_lightning.__spec__.name == lp.__name__
    )
    assert logging.getLogger("pytorch_lightning") is logging.getLogger("lightning.pytorch")
    trainer = pytorch_lightning.Trainer(max_steps=2, accelerator="cpu", logger=False,
                                        default_root_dir=tmp_path, **defaults())  # fmt: skip
    assert isinstance(trainer.progress_bar_callback, LoggingStepProgressBar)
    assert any(isinstance(c, SyncPointDetector) for c in trainer.callbacks)
    trainer.fit(BoringModel())
    assert trainer.global_step == 2


@pytest.mark.slow
def test_pytorch_lightning_imported_first_is_the_package_gpu_busy_uses(tmp_path):
    script = tmp_path / "first.py"
    script.write_text(
        "import pytorch_lightning as pl\n"
        "import gpu_busy\n"
        "from lightning.pytorch.demos.boring_classes import BoringModel\n"
        "from gpu_busy.callbacks import SyncPointDetector\n"
        "assert issubclass(SyncPointDetector, pl.Callback) and pl.__name__ == 'pytorch_lightning'\n"
        "trainer = pl.Trainer(max_steps=2, accelerator='cpu', **gpu_busy.defaults())\n"
        "trainer.fit(BoringModel())\n"
        "print('steps', trainer.global_step)\n"
    )  # fmt: skip
    ran = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=HANG_S)  # fmt: skip
    assert ran.returncode == 0 and ran.stdout.splitlines()[-1] == "steps 2", ran.stderr[-3000:]
    assert "fit done" in ran.stderr, ran.stderr[-3000:]
    # both imported before gpu_busy: two packages, and the set says whose it is
    script.write_text(
        "import lightning.pytorch, pytorch_lightning, gpu_busy\ngpu_busy.defaults()\n"
    )
    ran = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=HANG_S)  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    said = "the set is lightning.pytorch's (lightning.pytorch and pytorch_lightning were both"
    assert said in ran.stderr, ran.stderr[-3000:]


@pytest.mark.slow
def test_a_pytorch_lightning_cli_script_gets_the_set(tmp_path):
    script = tmp_path / "cli.py"
    script.write_text(
        "from pytorch_lightning.cli import LightningCLI\n"
        "from pytorch_lightning.demos.boring_classes import BoringDataModule, BoringModel\n"
        "LightningCLI(BoringModel, BoringDataModule)\n"
    )
    ran = launch([str(script), "fit", "--trainer.max_steps=3", "--trainer.accelerator=cpu"],
                 cwd=tmp_path)  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stderr.count(ADDED) == 1 and "3 steps" in ran.stderr, ran.stderr[-3000:]


@pytest.mark.slow
def test_lightnings_pytorch_lightning_bug_report_runs_unchanged_with_the_set(tmp_path):
    script = tmp_path / "pl_bug_report_model.py"
    shutil.copy(HERE / "lightning_examples" / "pl_bug_report_model.py", script)
    ran = launch([str(script)], cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stderr.count(ADDED) == 1 and ran.stderr.count("fit done") == 1, ran.stderr[-3000:]
    assert list(tmp_path.glob("lightning_logs/version_0/run.json")), ran.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["one", "ddp", "ddp_spawn", "torchrun"])
def test_a_pytorch_lightning_script_mixing_both_names_gets_the_set_on_every_rank(
    tmp_path, strategy
):
    """``pl`` from pytorch_lightning, and (with 2 ranks) its own bar and checkpoint from
    lightning.pytorch: one package, so the Trainer keeps them as its own (a plain run refuses
    the mix: two progress bars); the sync named at its line; on one process, without the
    mix, a plain run's values."""
    args = [str(USER), "--record", str(tmp_path)]
    if strategy != "one":
        args += ["--own-bar", "--devices", "2",
                 "--strategy", "ddp" if strategy == "torchrun" else strategy]  # fmt: skip
    name = {"USER_TRAIN_LIGHTNING": "pytorch_lightning"}
    if strategy == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "-m", "gpu_busy", "run", *args]  # fmt: skip
        ran = subprocess.run(command, cwd=tmp_path, env=_env(**name), capture_output=True,
                             text=True, timeout=HANG_S)  # fmt: skip
    else:
        ran = launch(args, cwd=tmp_path, **name)
    out = ran.stdout + ran.stderr
    assert ran.returncode == 0, out[-3000:]
    ranks = _callbacks_by_rank(tmp_path)
    assert len(ranks) == (1 if strategy == "one" else 2), out[-3000:]
    bar = "TQDMProgressBar" if strategy != "one" else "LoggingStepProgressBar"
    assert all("SyncPointDetector" in names and bar in names for names in ranks.values()), ranks
    assert out.count("fit done") == 1, out[-3000:]
    assert "user_train.py:36  [training_step]  Tensor.item()" in out, out[-3000:]
    if strategy != "one":
        assert "kept the Trainer's own ModelCheckpoint, TQDMProgressBar" in out, out[-3000:]
    else:
        plain = subprocess.run([sys.executable, str(USER)], cwd=tmp_path,
                               env=_env(**name), capture_output=True, text=True,
                               timeout=HANG_S)  # fmt: skip
        assert plain.returncode == 0, plain.stderr[-3000:]
        assert ran.stdout.splitlines()[-1] == plain.stdout.splitlines()[-1]


@pytest.mark.parametrize("loop", ["plain", "fabric"])
def test_a_script_with_no_trainer_is_told_and_strict_fails_it(loop, capsys, monkeypatch):
    from gpu_busy.launcher import main

    script = str(HERE / "scripts" / "no_trainer.py")
    args = [script, *(["fabric"] if loop == "fabric" else [])]
    monkeypatch.setenv("GPU_BUSY_STRICT_SYNCS", "0")  # the launcher's --strict sets it
    assert main(["run", *args]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    why = "trains with Fabric" if loop == "fabric" else "built no Lightning Trainer"
    assert err[-1].startswith("gpu_busy: nothing attached, nothing measured") and why in err[-1]
    assert main(["run", "--strict", *args]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("--strict: exit 1")


def test_a_hydra_apps_ranks_start_through_the_launcher_with_its_overrides(monkeypatch):
    """Lightning starts a Hydra app's other ranks with ``_hydra_subprocess_cmd``: the
    script's start is replaced by the launcher's, Hydra's overrides and its cwd kept."""
    from lightning.fabric.strategies.launchers import subprocess_script as fabric_launcher
    from lightning.pytorch.strategies.launchers import subprocess_script as launcher

    from gpu_busy.lightning_compat import children_run_through

    def hydras(local_rank):  # what Lightning's returns for `python src/train.py trainer=ddp`
        return [sys.executable, "/p/src/train.py", "trainer=ddp",
                f"hydra.job.name=train_ddp_process_{local_rank}"], "/p"  # fmt: skip

    for module in (launcher, fabric_launcher):
        monkeypatch.setattr(module, "_hydra_subprocess_cmd", hydras)
    ours = [sys.executable, "-m", "gpu_busy", "run", "/p/src/train.py"]
    undo = children_run_through(ours)
    try:
        for module in (launcher, fabric_launcher):
            command, cwd = module._hydra_subprocess_cmd(1)
            assert command == [*ours, "trainer=ddp", "hydra.job.name=train_ddp_process_1"]
            assert cwd == "/p"
    finally:
        undo()
    assert launcher._hydra_subprocess_cmd is hydras
