"""The entry point as users call it: every config parses and fits, bad input is one line."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import CONFIGS, DEBUG, DEFAULT, HANG_S, ROOT, cli_main, run_entry_point

main = cli_main()  # skips this module where the entry point cannot be imported

OVERLAYS = sorted(p.name for p in CONFIGS.glob("*.yaml") if p.name != "default.yaml")
# Small enough for a 2-core CI machine: a tiny model on a few batches.
TINY = [
    "--model.width=4",
    "--data.synthetic_train_size=128",
    "--data.synthetic_val_size=64",
    "--data.batch_size=16",
    "--trainer.limit_train_batches=2",
    "--trainer.limit_val_batches=1",
    "--trainer.enable_model_summary=false",
]


def fit(*args: str) -> int:
    return main(["fit", "--config", DEFAULT, *args])


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def test_every_config_parses(capsys):
    for name in ["default.yaml", *OVERLAYS]:
        args = ["fit", "--config", DEFAULT, "--config", str(CONFIGS / name), "--print_config"]
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code in (0, None), name
        assert "model:" in capsys.readouterr().out, name


def test_only_the_asked_subcommand_is_built_and_help_lists_all_four(monkeypatch, capsys):
    """Each subcommand's parser reads every signature again: a run builds its own only."""
    from lightning.pytorch.cli import LightningCLI

    built = []
    original = LightningCLI._prepare_subcommand_parser

    def prepare(self, klass, subcommand, **kwargs):
        built.append(subcommand)
        return original(self, klass, subcommand, **kwargs)

    monkeypatch.setattr(LightningCLI, "_prepare_subcommand_parser", prepare)
    with pytest.raises(SystemExit):
        main(["validate", "--config", DEFAULT, "--print_config"])
    assert built == ["validate"] and "model:" in capsys.readouterr().out
    built.clear()
    with pytest.raises(SystemExit):
        main(["--help"])
    assert built == ["fit", "validate", "test", "predict"]
    assert "{fit,validate,test,predict}" in capsys.readouterr().out


@pytest.mark.parametrize("overlay", ["default.yaml", "cpu.yaml", "debug.yaml"])
def test_short_fit_of_synthetic_configs(in_tmp, overlay):
    assert fit("--config", str(CONFIGS / overlay), "--trainer.max_epochs=1", *TINY) == 0
    name = "debug" if overlay == "debug.yaml" else "default"
    run_dir = in_tmp / "runs" / name / "version_0"
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert (run_dir / "config.yaml").is_file()
    assert any(row["val/acc"] for row in read_metrics(run_dir))


def test_short_fit_of_cifar10_config_offline(in_tmp, cifar_root):
    root, _ = cifar_root
    args = ["--config", str(CONFIGS / "cifar10.yaml"), f"--data.data_dir={root}"]
    assert fit(*args, "--data.download=false", "--trainer.max_epochs=1", *TINY) == 0
    assert (in_tmp / "runs" / "cifar10" / "version_0" / "checkpoints" / "last.ckpt").is_file()


def test_short_fit_of_folder_config(in_tmp, image_folder):
    args = ["--config", str(CONFIGS / "folder.yaml"), f"--data.data_dir={image_folder}"]
    assert fit(*args, "--data.image_size=16", "--trainer.max_epochs=1", *TINY) == 0
    run_dir = in_tmp / "runs" / "folder" / "version_0"
    assert "num_classes: 3" in (run_dir / "hparams.yaml").read_text()


@pytest.mark.slow
def test_default_pipeline_learns_far_above_chance(in_tmp):
    # The embedded data has real class structure: a short run beats chance (10%) by far.
    args = ["--config", str(CONFIGS / "cpu.yaml"), "--model.width=8"]
    data = [
        "--data.synthetic_train_size=2560",
        "--data.synthetic_val_size=500",
        "--data.batch_size=64",
    ]
    assert fit(*args, *data, "--trainer.max_epochs=3", "--trainer.enable_model_summary=false") == 0
    rows = read_metrics(in_tmp / "runs" / "default" / "version_0")
    final = [float(r["val/acc"]) for r in rows if r["val/acc"]][-1]
    assert final > 0.5, final


def test_the_default_fit_passes_the_strict_sync_check(in_tmp):
    """What CI checks of your model without a GPU: no step past the first makes the host wait
    for the device (an ``.item()`` in ``training_step`` fails this fit at its line)."""
    steps = ["--trainer.limit_train_batches=8", "--trainer.log_every_n_steps=4"]
    assert fit("--config", DEBUG, "--gpu_busy.strict=true", *steps) == 0
    report = json.loads((in_tmp / "runs" / "debug" / "version_0" / "syncs.json").read_text())
    assert report["summary"]["watched_batches"] >= 1, report["summary"]
    assert report["summary"]["steady_syncs_per_batch"] == 0, report["sites"]


def test_resume_from_last_checkpoint_continues_the_run(in_tmp, capsys):
    assert fit("--config", DEBUG, "--trainer.max_epochs=1") == 0
    first = read_metrics(in_tmp / "runs" / "debug" / "version_0")
    assert fit("--config", DEBUG, "--trainer.max_epochs=2", "--ckpt_path=last") == 0
    err = capsys.readouterr().err
    assert "resuming from runs/debug/version_0/checkpoints/last.ckpt" in err
    second = read_metrics(in_tmp / "runs" / "debug" / "version_1")
    # The resumed run starts at epoch 1 and continues the step count.
    assert {r["epoch"] for r in second} == {"1"}
    last_step_first = max(int(r["step"]) for r in first)
    assert min(int(r["step"]) for r in second) > last_step_first
    state = torch.load(
        in_tmp / "runs" / "debug" / "version_1" / "checkpoints" / "last.ckpt",
        map_location="cpu",
        weights_only=True,
    )
    assert state["epoch"] == 1 and state["global_step"] == 8


def test_resume_last_without_a_checkpoint_starts_fresh(in_tmp, capsys):
    assert fit("--config", DEBUG, "--ckpt_path=last") == 0
    assert "no last.ckpt under runs/debug; training from scratch" in capsys.readouterr().err


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--trainer.no_such_key=1"], "the command line: trainer.no_such_key is not an option"),
        (
            ["--data.batch_size=many"],
            "the command line: data.batch_size=many: expected int",
        ),
        (["--data.batch_size=0"], "data.batch_size must be at least 1"),
        (["--model.depth=19"], "depth must be one of [18, 34]"),
        (["--config", "configs/no_such.yaml"], "File does not exist"),
        (["--trainer.accelerator=gpu", "--trainer.devices=64"], "trainer.devices=64: "),
        (["--ckpt_path=missing.ckpt"], "checkpoint missing.ckpt does not exist"),
        (["--data.dataset=folder", "--data.data_dir=nowhere"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(in_tmp, capsys, args, expected):
    assert fit(*args) == 2
    assert expected.lower() in _one_error_line(capsys).lower()  # capitals vary by release
    assert not (in_tmp / "runs").exists(), "a refused run must not create a run directory"


def test_file_that_is_not_a_checkpoint_is_refused(in_tmp, capsys):
    (in_tmp / "notes.ckpt").write_text("not a checkpoint")
    assert fit("--ckpt_path=notes.ckpt") == 2
    assert "notes.ckpt is not a checkpoint" in _one_error_line(capsys)


def test_cifar10_offline_without_a_copy_says_where_it_looked(in_tmp, capsys):
    assert fit("--config", str(CONFIGS / "cifar10.yaml"), "--data.download=false") == 2
    line = _one_error_line(capsys)
    assert str(in_tmp / "data" / "cifar-10-batches-py") in line and "download" in line


@pytest.mark.slow
def test_the_real_command_prints_no_traceback(tmp_path):
    (tmp_path / "bad.ckpt").write_bytes(b"\x00" * 64)
    result = run_entry_point(["fit", "--config", DEFAULT, "--ckpt_path=bad.ckpt"], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2 GPUs")
def test_make_train_gpus_2_without_gpus_fails_before_spawning(tmp_path):
    result = subprocess.run(
        ["make", "--no-print-directory", "train", "GPUS=2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert result.returncode != 0
    found = torch.cuda.device_count()
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1
    assert "trainer.accelerator=gpu trainer.devices=2: " in lines[0]
    assert f"(this machine has {found} GPU(s)); run `make train" in lines[0]
    assert "Traceback" not in result.stderr


def test_the_entry_point_gives_the_callers_matmul_precision_back(in_tmp):
    # Process-wide TF32 would leak into every test run after an in-process fit.
    torch.set_float32_matmul_precision("highest")
    args = ["--config", DEBUG, "--trainer.limit_train_batches=1", "--trainer.limit_val_batches=0"]
    assert main(["fit", "--config", DEFAULT, *args]) == 0
    assert torch.get_float32_matmul_precision() == "highest"


def test_a_swapped_in_model_trains_with_its_own_defaults_and_is_told_so(in_tmp, capsys):
    """jsonargparse hands a new class_path the init_args it also accepts: the example's
    lr=0.4 would train your model at chance. It gets its own, said at the start and again
    under the summary."""
    swap = ["--model.class_path=tests.helpers.foreign_modules.BlobClassifier",
            "--data.class_path=tests.helpers.foreign_modules.BlobData",
            "--trainer.max_epochs=1"]  # fmt: skip
    assert main(["fit", "--config", DEFAULT, "--config", DEBUG, *swap]) == 0
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "does not take lr=0.4" in x]
    assert len(lines) == 2 and lines[0].split("WARNING")[-1] == lines[1].split("WARNING")[-1]
    assert "set there for template.models.ImageClassifier" in lines[0]
    assert "its own lr=0.01" in lines[0] and "--model.<name>=<value>" in lines[0]
    assert err.index("fit done in") < err.rindex("does not take lr=0.4")  # under the summary
    hparams = yaml.safe_load(next(Path("runs").rglob("hparams.yaml")).read_text())
    assert hparams["lr"] == 0.01  # BlobClassifier's own default reached the model
    # Set on the command line, the value is the user's own: nothing to say.
    assert main(["fit", "--config", DEFAULT, "--config", DEBUG, *swap, "--model.lr=0.05"]) == 0
    assert "does not take" not in capsys.readouterr().err
    # The example itself keeps its settings silently, and so does a subclass of it: the
    # settings mean to it what they mean to the example.
    assert main(["fit", "--config", DEFAULT, "--config", DEBUG]) == 0
    assert "does not take" not in capsys.readouterr().err
    subclass = "--model.class_path=tests.helpers.bound_runs.ProgBarImageClassifier"
    assert main(["fit", "--config", DEFAULT, "--config", DEBUG, subclass]) == 0
    assert "does not take" not in capsys.readouterr().err


@pytest.mark.slow
def test_a_newcomers_adam_model_learns_on_the_example_data_with_its_own_lr(in_tmp, capsys):
    """The README's path: one's own class on the example's data. With the example's
    lr=0.4 Adam sits at chance (0.1); with its own 1e-3 it learns."""
    args = ["fit", "--config", DEFAULT, "--config", DEBUG,
            "--model.class_path=tests.helpers.foreign_modules.ImageMLP",
            "--trainer.max_epochs=4", "--trainer.limit_train_batches=null",
            "--trainer.limit_val_batches=null", "--data.synthetic_train_size=2048",
            "--data.batch_size=64"]  # fmt: skip
    assert main(args) == 0
    (done,) = [x for x in capsys.readouterr().err.splitlines() if "fit done in" in x]
    accuracy = float(done.split("val/acc ")[1].split(";")[0])
    assert accuracy > 0.2, done


def test_a_setting_a_swapped_in_class_requires_is_not_taken_from_another_class(in_tmp, capsys):
    swap = "--model.class_path=tests.helpers.foreign_modules.NeedsLr"
    assert main(["fit", "--config", DEFAULT, "--config", DEBUG, swap]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert "NeedsLr needs lr, which the config files set only for" in line
    assert "pass --model.lr=<value>" in line


def readme_block(after: str) -> list[str]:
    """The lines of README's first ``bash`` block after the text ``after``."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```bash\n", text.index(after)) + len("```bash\n")
    return text[start : text.index("```", start)].strip().splitlines()


@pytest.mark.slow
def test_readmes_checkpoint_commands_write_inside_the_run(in_tmp, capsys):
    """validate, test and predict, as README shows them: no new version folder, the
    outputs inside the run, the predictions saved and said where."""
    assert main(["fit", "--config", DEFAULT, "--config", DEBUG]) == 0
    run = Path("runs/debug/version_0")
    lines = readme_block("**Using a checkpoint.**")
    assert lines[0] == "RUN=runs/default/version_0"
    capsys.readouterr()
    for line in lines[1:]:
        words = line.replace("$RUN", str(run)).split()
        assert words[:3] == [".venv/bin/python", "-m", "template.train"], line
        assert main(words[3:]) == 0, line
    assert sorted(p.name for p in Path("runs/debug").iterdir()) == ["version_0"]
    for name in ("validate-last", "test-last"):
        assert (run / name / "metrics.csv").is_file()
    predictions = torch.load(run / "predict-last" / "predictions.pt", weights_only=True)
    assert predictions.shape == (128,) and predictions.dtype == torch.int64  # debug.yaml: 128
    err = capsys.readouterr().err
    assert f"predict: 128 predictions written to {run}/predict-last/predictions.pt" in err
    assert "hyperparameters replace" not in err  # the run's config: its own width
    # What the libraries print on every run, seen as a user sees it (a real process).
    result = run_entry_point(words[3:], cwd=in_tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "predict: 128 predictions written to" in out
    for noise in ("litlogger", "LeafSpec", "dirpath has changed"):
        assert noise not in out, noise


def test_every_pointer_into_readme_names_a_part_of_it():
    """`README, "Part"` in the code and docs names a heading or a bold lead of README."""
    import re

    readme = (ROOT / "README.md").read_text()
    prose = re.sub(r"```.*?```", "", readme, flags=re.S)  # code's `**kwargs` is no bold
    parts = set(re.findall(r"^#+ (.+)$", prose, re.M))
    parts |= {m.rstrip(".") for m in re.findall(r"\*\*([^*]+)\*\*", prose)}
    pointers = []
    for folder in ("gpu_busy", "pytest_gpu_busy", "template", "bench", "scripts", "docs"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md"):
                for name in re.findall(r"README[,(]? ?\(?\"([^\"]+)\"", path.read_text()):
                    pointers.append((path.relative_to(ROOT), name))
    assert pointers
    assert [(str(p), n) for p, n in pointers if n not in parts] == []


@pytest.mark.parametrize(
    ("cuda", "flags", "cpu_overlay"),
    [
        (True, [], False),
        (False, [], True),
        (True, ["ACCELERATOR=cpu", "DEVICES=2"], True),
        (True, ["GPUS=2"], False),
        (False, ["CPU_CONFIG="], False),
        (False, ["STRATEGY=fsdp", "ACCELERATOR=cpu", "DEVICES=2"], True),
    ],
)
def test_make_train_adds_the_cpu_overlay_where_no_gpu_trains(tmp_path, cuda, flags, cpu_overlay):
    """The default config is the GPU run; `make train` adds configs/cpu.yaml (a narrower
    model, fewer images) exactly where it will train on the CPU."""
    fake = tmp_path / "python"  # answers the Makefile's CUDA question, echoes the command
    fake.write_text(f'#!/bin/sh\n[ "$1" = -c ] && exit {0 if cuda else 1}\necho "ran: $*"\n')
    fake.chmod(0o755)
    result = subprocess.run(
        ["make", "--no-print-directory", "-o", "install", "train", f"PY={fake}", *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (ran,) = [line for line in result.stdout.splitlines() if line.startswith("ran: ")]
    assert ran.startswith("ran: -m template.train fit --config configs/default.yaml")
    assert ("--config configs/cpu.yaml" in ran) == cpu_overlay
    # STRATEGY=fsdp: the sharding overlay, after the CPU one
    assert ("--config configs/fsdp.yaml" in ran) == ("STRATEGY=fsdp" in flags)


def test_the_default_config_is_the_gpu_run_and_the_cpu_overlay_keeps_the_cpu_run(capsys):
    """configs/default.yaml is sized for a GPU (batch 1024, 48 steps an epoch: GPU-bound on
    an H100, docs/BENCHMARKS.md), its epoch a number of optimizer steps so that a larger
    batch keeps them; with configs/cpu.yaml the CPU run is the one it was."""

    def resolved(*overlays: str) -> dict:
        args = ["fit", "--config", DEFAULT, *[a for o in overlays for a in ("--config", o)]]
        with pytest.raises(SystemExit):
            main([*args, "--print_config"])
        config = yaml.safe_load(capsys.readouterr().out)
        model, data = config["model"]["init_args"], config["data"]["init_args"]
        return {
            "width": model["width"], "compile": model["compile"],
            "batch": data["batch_size"], "images": data["synthetic_train_size"],
            "steps_per_epoch": data["synthetic_steps_per_epoch"],
            "epochs": config["trainer"]["max_epochs"], "precision": config["trainer"]["precision"],
        }  # fmt: skip

    # 288 steps: 6 epochs of 48; 192: 3 epochs of 64 (8,192 images: the CPU run as it was)
    assert resolved() == {
        "width": 64, "compile": False, "batch": 1024, "images": None, "steps_per_epoch": 48,
        "epochs": 6, "precision": None,
    }  # fmt: skip
    assert resolved(str(CONFIGS / "cpu.yaml")) == {
        "width": 16, "compile": False, "batch": 128, "images": None, "steps_per_epoch": 64,
        "epochs": 3, "precision": None,
    }  # fmt: skip


def test_a_run_from_the_command_line_warns_of_nothing_the_user_did(in_tmp, monkeypatch):
    """Lightning warns when LightningCLI gets args= while sys.argv has arguments too, as
    every `make train` has: main passes the arguments it checked, so that one is ours."""
    import warnings

    args = ["fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.max_steps=1"]
    monkeypatch.setattr("sys.argv", ["train.py", *args])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(args) == 0
    assert not [w for w in caught if "args parameter" in str(w.message)], caught
