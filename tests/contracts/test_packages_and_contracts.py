"""The two halves stay apart, and what README promises a model, a DataModule and a reader
of the metrics is what the code does."""

from __future__ import annotations

import ast
import csv
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from gpu_busy.idle import IdleStats
from gpu_busy.prefetch import PrefetchStats
from gpu_busy.report.files import SCHEMA_VERSION
from template.data.augment import DeviceAugment
from tests.conftest import DEBUG, DEFAULT, HANG_S, ROOT, cli_main

main = cli_main()  # skips this module where the entry point cannot be imported

FOREIGN = [
    "--model.class_path=tests.helpers.foreign_modules.BlobClassifier",
    "--data.class_path=tests.helpers.foreign_modules.BlobData",
    "--trainer.max_epochs=2",
    "--trainer.log_every_n_steps=4",
]


@pytest.mark.slow
def test_the_packages_command_line_trains_a_project_that_is_not_the_template(tmp_path):
    """gpu_busy.cli as another project's entry point: Lightning's demo model and data,
    one line for a mistake, and the example package never imported."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            from gpu_busy.cli import main

            demo = "lightning.pytorch.demos.boring_classes"
            args = ["fit", f"--model={demo}.BoringModel", f"--data={demo}.BoringDataModule",
                    "--trainer.max_epochs=1", "--trainer.limit_train_batches=4",
                    "--trainer.limit_val_batches=1", "--trainer.accelerator=cpu"]
            code = main([*args, *sys.argv[1:]])
            assert not [m for m in sys.modules if m.split(".")[0] == "template"]
            sys.exit(code)
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = [sys.executable, "train.py"]
    result = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=HANG_S)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_epochs=1` reached" in result.stderr
    bad = subprocess.run([*run, "--trainer.max_epoch=2"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=HANG_S)  # fmt: skip
    assert bad.returncode == 2
    (line,) = [x for x in bad.stderr.splitlines() if x.startswith("error:")]
    assert line == (
        "error: the command line: trainer.max_epoch is not an option; did you mean "
        "trainer.max_epochs? (python train.py fit --help lists every option)"
    )


@pytest.mark.slow
def test_the_measuring_package_serves_a_plain_lightning_script(tmp_path):
    """gpu_busy with every callback, in a script that is not the template, where the
    example package cannot even be imported."""
    script = tmp_path / "plain.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import lightning.pytorch as pl
            from lightning.pytorch.demos.boring_classes import BoringModel
            from lightning.pytorch.loggers import CSVLogger
            from gpu_busy import callbacks as cb

            trainer = pl.Trainer(
                accelerator="cpu", max_epochs=2, limit_train_batches=16, limit_val_batches=2,
                log_every_n_steps=4, logger=CSVLogger("runs"), enable_model_summary=False,
                callbacks=[getattr(cb, name)() for name in cb.__all__],
            )
            trainer.fit(BoringModel())
            try:
                import template  # noqa: F401
                sys.exit("the example package was importable")
            except ImportError:
                pass
            assert not [m for m in sys.modules if m.split(".")[0] == "template"]
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "lightning_logs" / "version_0"
    for name in ("idle.json", "syncs.json", "prefetch.json", "metrics.csv"):
        assert (run / name).is_file(), name
    # The reports print in a script that never configured logging...
    for line in ("sync points:", "idle time:", "prefetch:", "fit done in"):
        assert result.stderr.count(line) == 1, (line, result.stderr[-2000:])
    # ...and once, not twice, in one that did.
    configured = "import logging; logging.basicConfig(level=logging.INFO)\n"
    script.write_text(configured + script.read_text())
    again = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr[-3000:]
    for line in ("sync points:", "idle time:", "prefetch:", "fit done in"):
        assert again.stderr.count(line) == 1, (line, again.stderr[-2000:])


def test_a_foreign_module_and_datamodule_train_by_class_path_with_every_callback(in_tmp, capsys):
    assert main(["fit", "--config", DEFAULT, "--config", DEBUG, *FOREIGN]) == 0
    run = in_tmp / "runs" / "debug" / "version_0"
    for name in ("idle.json", "syncs.json", "prefetch.json", "idle.png"):
        assert (run / name).is_file(), name
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["hyper_parameters"]["num_classes"] == 5  # linked from data.num_classes
    assert list((run / "checkpoints").glob("best-*.ckpt"))
    err = capsys.readouterr().err
    # The summary reports the metric the best checkpoint monitors: named once, in the config.
    (summary,) = [line for line in err.splitlines() if "fit done in" in line]
    assert "val/acc" in summary and "samples" in summary


def test_the_num_classes_link_skips_a_model_that_does_not_take_it(in_tmp):
    args = [*FOREIGN, "--model.class_path=tests.helpers.foreign_modules.FixedHeadClassifier"]
    assert main(["fit", "--config", DEFAULT, "--config", DEBUG, *args]) == 0


def test_a_model_that_does_not_log_the_monitored_metric_trains_with_one_warning(in_tmp, capsys):
    code = main(
        ["fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.max_epochs=2",
         "--model.class_path=lightning.pytorch.demos.boring_classes.BoringModel",
         "--data.class_path=lightning.pytorch.demos.boring_classes.BoringDataModule"]
    )  # fmt: skip
    assert code == 0
    err = capsys.readouterr().err
    assert err.count("no best checkpoint: the model never logged 'val/acc'") == 1
    checkpoints = in_tmp / "runs" / "debug" / "version_0" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt"]


def test_device_augmentation_refuses_batches_that_are_not_uint8():
    augment = DeviceAugment()
    images = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    assert augment(images, train=True).dtype == torch.float32
    with pytest.raises(TypeError, match="uint8"):
        augment(images.float(), train=True)


def _documented_metrics() -> set[str]:
    text = (ROOT / "docs" / "GUIDE.md").read_text()
    return set(re.findall(r"`((?:idle|prefetch|syncs)/[a-z_]+)`", text))


def test_every_documented_metric_is_logged_and_every_logged_one_documented(in_tmp):
    code = main(
        ["fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.limit_train_batches=12",
         "--trainer.log_every_n_steps=4", "--trainer.max_epochs=1"]
    )  # fmt: skip
    assert code == 0
    with (in_tmp / "runs" / "debug" / "version_0" / "metrics.csv").open() as f:
        header = next(csv.reader(f))
    logged = {k for k in header if k.split("/")[0] in ("idle", "prefetch", "syncs")}
    assert {k for k in logged if k.startswith("syncs/")} == {
        "syncs/count", "syncs/per_batch", "syncs/per_steady_batch"
    }  # fmt: skip
    # Every figure the mechanisms produce, GPU-only ones included (None, unlogged, on a CPU).
    declared = {f"idle/{k}" for k in IdleStats().means(cuda=True)}
    declared |= {f"prefetch/{k}" for k in PrefetchStats().means()}
    declared |= {k for k in logged if k.startswith("syncs/")} | {"idle/window_steps"}
    documented = _documented_metrics()
    assert documented == declared, (documented - declared, declared - documented)
    assert logged <= documented, logged - documented
    # Under DDP each has a _rank_max twin (tests/whole/test_ddp.py); the guide says so.
    assert "_rank_max" in (ROOT / "docs" / "GUIDE.md").read_text()


@pytest.mark.slow  # two fits of 12 batches with a resume: 6 s
def test_a_window_cut_short_by_the_warm_up_or_a_resume_says_how_many_steps_it_covers(in_tmp):
    # A resumed run's first logged means once covered only the steps since the resume, with
    # nothing to tell that row from a whole window's.
    args = ["--config", DEFAULT, "--config", DEBUG, "--trainer.limit_train_batches=12",
            "--trainer.log_every_n_steps=4", "--trainer.limit_val_batches=1"]  # fmt: skip
    assert main(["fit", *args, "--trainer.max_epochs=1", "--trainer.max_steps=9"]) == 0
    assert main(["fit", *args, "--trainer.max_epochs=2", "--ckpt_path=last"]) == 0

    def windows(version: int) -> dict[str, list[tuple[int, int]]]:
        path = in_tmp / "runs" / "debug" / f"version_{version}" / "metrics.csv"
        with path.open() as f:
            rows = list(csv.DictReader(f))
        return {
            name: [(int(r["step"]), int(float(r[name]))) for r in rows if r.get(name)]
            for name in ("idle/window_steps", "throughput/window_steps")
        }

    # Each fit leaves out its first 5 steps (the monitors' default warm-up). The first run times
    # steps 5-7 of the window that ends at step 7; the resumed one (from step 9) times steps
    # 14-15, then whole windows of 4.
    assert windows(0) == {"idle/window_steps": [(7, 3)], "throughput/window_steps": [(7, 3)]}
    resumed = windows(1)
    assert resumed["idle/window_steps"] == resumed["throughput/window_steps"]
    assert resumed["idle/window_steps"][:2] == [(15, 2), (19, 4)], resumed


def test_reports_name_ranks_and_keep_one_name_per_quantity(in_tmp):
    assert main(["fit", "--config", DEFAULT, "--config", DEBUG]) == 0
    idle = json.loads((in_tmp / "runs" / "debug" / "version_0" / "idle.json").read_text())
    assert [r["rank"] for r in idle["ranks"]] == [0] and idle["schema_version"] == SCHEMA_VERSION
    assert "loader_wait_ms" in idle["mean"] and "host_data_wait_ms" not in idle["mean"]
    assert "prefetch" not in idle and "syncs" not in idle  # each callback its own file


def test_the_tensorboard_overlay_trains_or_says_in_one_line_what_to_install(in_tmp, capsys):
    import importlib.util

    overlay = str(ROOT / "configs" / "tensorboard.yaml")
    code = main(["fit", "--config", DEFAULT, "--config", DEBUG, "--config", overlay])
    if importlib.util.find_spec("tensorboard") is not None:
        assert code == 0
        assert list((in_tmp / "runs" / "default" / "version_0").glob("events.out.tfevents.*"))
    else:  # the optional extra is not installed: one line that names it
        assert code == 2
        (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
        assert "tensorboard" in line


def test_make_train_puts_runs_where_runs_says():
    result = subprocess.run(
        ["make", "-n", "train", "RUNS=/scratch/me/runs", "PY=python3"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "--trainer.logger.init_args.save_dir=/scratch/me/runs" in result.stdout


@pytest.mark.slow
def test_the_gpu_suite_collects_without_the_cli_dependency(tmp_path):
    """A GPU machine may have torch and lightning but not jsonargparse: the tests that need
    the entry point skip, every other test is collected and runs."""
    blocked = tmp_path / "blocked" / "jsonargparse"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ModuleNotFoundError('no jsonargparse here')\n")
    env = {**os.environ, "PYTHONPATH": f"{blocked.parent}{os.pathsep}{ROOT}"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
         "-p", "no:cacheprovider", "-o", "addopts="],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "ERROR collecting" not in out and " error" not in out.splitlines()[-1], out[-3000:]
    collected = [line for line in result.stdout.splitlines() if "test_gpu.py::" in line]
    assert len(collected) > 50, out[-2000:]  # the GPU tests, the case list among them


def test_a_model_with_its_own_dataloaders_needs_no_datamodule(in_tmp):
    code = main(
        ["fit", "--config", DEFAULT, "--config", DEBUG, "--data=null",
         "--model.class_path=lightning.pytorch.demos.boring_classes.BoringModel"]
    )  # fmt: skip
    assert code == 0
    assert (in_tmp / "runs" / "debug" / "version_0" / "checkpoints" / "last.ckpt").is_file()


def test_the_gpu_suite_fails_when_a_required_check_skips(tmp_path):
    junit = tmp_path / "gpu_tests.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.gpu.test_gpu" name="test_a"/>'
        '<testcase classname="tests.gpu.test_gpu" name="test_b">'
        '<skipped message="the entry point (LightningCLI) needs jsonargparse"/></testcase>'
        "</testsuite></testsuites>"
    )
    bench = tmp_path / "bench.txt"
    bench.write_text("claim overlap  ok\nclaim start-up  not run (the entry point needs ...)\n")
    script = [sys.executable, str(ROOT / "scripts" / "required_checks.py"), str(junit), str(bench)]
    result = subprocess.run(script, capture_output=True, text=True, timeout=HANG_S)
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 1
    assert lines[-1] == "required GPU checks: 1 run, 2 skipped", result.stdout
    assert any("test_b" in line and "jsonargparse" in line for line in lines)
    junit.write_text(
        '<testsuites><testsuite><testcase classname="t" name="a"/></testsuite></testsuites>'
    )
    bench.write_text("claim overlap  ok\n")
    result = subprocess.run(script, capture_output=True, text=True, timeout=HANG_S)
    assert (
        result.returncode == 0 and result.stdout.strip() == "required GPU checks: 1 run, 0 skipped"
    )


def _import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """gpu_busy's modules -> the gpu_busy modules and the top-level packages each imports,
    function-level (lazy) imports included."""
    files = {}
    for path in (ROOT / "gpu_busy").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    inner = {m: set() for m in files}
    outer = {m: set() for m in files}
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
                # `from gpu_busy import syncs` imports the submodule; the package itself
                # counts where a name is one of its own members
                if not all(n in files for n in names):
                    names.append(node.module)
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            inner[module] |= {n for n in names if n in files and n != module}
            outer[module] |= {n.split(".")[0] for n in names}
    return inner, outer


def test_layers_mechanisms_import_no_lightning_nor_the_report_layer_and_nothing_cycles():
    inner, outer = _import_graph()
    mechanisms = [m for m in inner if f"{m}.".split(".")[1] in MECHANISMS]
    assert len(mechanisms) > 20
    for m in mechanisms:
        assert "lightning" not in outer[m], m
        upward = {n for n in inner[m] if f"{n}.".split(".")[1] in ("report", "callbacks", "cli")}
        assert not upward, (m, upward)
    for m in inner:
        # the report layer sits beside the callbacks, not above them; the command line uses
        # only the default set of them
        callbacks = {n for n in inner[m] if n.startswith("gpu_busy.callbacks")}
        if m.startswith("gpu_busy.report"):
            assert not callbacks, m
        if m.startswith("gpu_busy.cli"):
            assert callbacks <= {"gpu_busy.callbacks.default_set"}, m

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for n in inner[todo.pop()] - seen:
                seen.add(n)
                todo.append(n)
        return seen

    assert [m for m in inner if m in reach(m)] == []

    # Floors: the rooms of gpu_busy (its first-level modules and folders) stacked by their
    # imports, no room importing one on its floor or above: at most 7.
    def room(module: str) -> str:
        return ".".join(module.split(".")[:2])

    rooms: dict[str, set[str]] = {}
    doors = ("gpu_busy", "gpu_busy.__main__")  # the package's own: above every room, no room
    for m, names in inner.items():
        if m in doors:
            continue
        rooms.setdefault(room(m), set()).update(room(n) for n in names if room(n) != room(m))

    def floor(r: str, below: tuple[str, ...] = ()) -> int:
        assert r not in below, f"rooms import in a cycle: {(*below, r)}"
        return 1 + max((floor(n, (*below, r)) for n in rooms[r]), default=0)

    assert max(map(floor, rooms)) <= 7, {r: floor(r) for r in rooms}


MECHANISMS = (
    "idle", "syncs", "throughput", "faults", "resume", "prefetch", "batch_routing",
    "window_sums", "event_pool", "host_reads", "cuda_sync_warnings",
)  # fmt: skip


def test_readmes_map_names_every_module_and_folder_of_the_package():
    # "Yours and ours" is how a newcomer finds a room: a module it leaves out is a room no
    # one is told about.
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Yours and ours", 1)[1].split("```")[1]
    ours = block.split("gpu_busy/", 1)[1].split("\n", 1)[1].split("pytest_gpu_busy/", 1)[0]
    named = set(re.findall(r"\b([a-z_]+(?:\.py|/))", ours))
    package = ROOT / "gpu_busy"
    present = {
        p.name + ("/" if p.is_dir() else "")
        for p in package.iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py")
        or (p.is_dir() and (p / "__init__.py").exists())
    }
    assert present - named == set(), f"README's map leaves out {sorted(present - named)}"
    assert named - present == set(), f"README's map names what is gone: {sorted(named - present)}"


def test_the_schema_version_readme_states_is_the_one_the_reports_carry():
    from gpu_busy.report.files import SCHEMA_VERSION

    readme = (ROOT / "README.md").read_text()
    stated = re.findall(r"`schema_version` \((\d+)\)", readme)
    assert stated == [str(SCHEMA_VERSION)], stated


def test_the_accuracy_the_docs_promise_for_make_train_is_the_one_measured():
    """README and GUIDE state one range for `make train`'s validation accuracy, and every
    figure BENCHMARKS records for it lies inside."""
    readme = (ROOT / "README.md").read_text()
    guide = (ROOT / "docs" / "GUIDE.md").read_text()
    said = [
        re.search(r"validation accuracy(?: of)?\s+(0\.\d+) to (0\.\d+)", text).groups()
        for text in (readme, guide)
    ]
    assert said[0] == said[1], said
    low, high = map(float, said[0])
    row = next(
        line
        for line in (ROOT / "docs" / "BENCHMARKS.md").read_text().splitlines()
        if line.startswith("| `make train` |")
    )
    measured = [float(x) for x in re.findall(r"\b(0\.\d{3,4})\b", row)]
    assert measured and all(low <= m <= high for m in measured), (row, low, high)


def test_the_docs_state_results_in_a_readable_length():
    # README is the front door (what moves out goes to docs/GUIDE.md); the docs state the
    # current result and its command, and git keeps the history.
    readme = (ROOT / "README.md").stat().st_size
    docs = {p.name: p.stat().st_size for p in (ROOT / "docs").glob("*.md")}
    assert readme <= 15_000, f"README.md is {readme} bytes"
    # 184 KB: the any-script launcher and the default set's one rule added a section to
    # GUIDE and to ARCHITECTURE (issue 65); every rank's exit, and a measurement's failure
    # under DDP, one to ARCHITECTURE (issue 66), the duplicates in GUIDE cut for them; the
    # CPU-only rule, FLOPs that follow the model, samples per batch and the checkpoint
    # check a paragraph each (issue 67); both package names, a Fabric loop (issue 72)
    assert readme + sum(docs.values()) <= 184_000, (readme, docs)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_docs_reaches_its_file_and_heading():
    texts = {p: p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]}
    broken = []
    for path, text in texts.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            name, _, anchor = target.partition("#")
            file = (path.parent / name).resolve() if name else path
            if not file.exists():
                broken.append((path.name, target))
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append((path.name, target))
    assert broken == []


def test_no_module_of_the_package_is_too_long_to_hold_in_mind():
    # A room a maintainer can live in: past 500 lines a module is split by what each part
    # is (cli/, syncs/). The sync rules are one table, each row citing its source: they
    # stay together. Function size is ruff's C90 rule (pyproject.toml: complexity 15).
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted((ROOT / "gpu_busy").rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > 500 and p.name != "rules.py"
    }
    assert long == {}, f"modules over 500 lines: {long}"


# Writes onto another object that are not patches.patch, each with why.
NOT_A_PATCH = {
    "batch_routing.py:route_batches": "swaps the loader's class for a routing subclass: "
    "patch puts back attributes; unroute puts back the class",
    "batch_routing.py:unroute": "puts the loader's own class back",
    "callbacks/measurement.py:__init_subclass__": "wraps a subclass's own hooks as the class "
    "is made: defines ours, replaces no one's",
    "lightning_compat/hooks.py:skip_hooks": "a switch Lightning reads at every hook, flipped "
    "at step boundaries in the callback's own __dict__: set and removed, no undo to hold",
    "lightning_compat/logged_metrics.py:is_logging_step": "a cache entry of ours on the "
    "Trainer, keyed by the step: nothing of Lightning's replaced",
    "syncs/sites.py:merge": "sums another rank's counts into a site of our own table",
    "launcher.py:_run": "gives the script it runs as __main__ its sys.argv and sys.path[0], "
    "as python does for a script: the process is the script's from then on",
}


def _writes_onto_others(path: Path) -> set[str]:
    """``file:function`` of each ``setattr`` on another object, ``__class__`` or
    ``__dict__[...]`` assignment, or assignment to an imported module's attribute."""
    tree = ast.parse(path.read_text())
    modules = {
        a.asname or a.name.split(".")[0]
        for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }  # fmt: skip
    where = str(path.relative_to(ROOT / "gpu_busy"))
    found = set()

    def writes(node: ast.AST) -> bool:
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr":
            return getattr(node.args[0], "id", None) != "self"
        targets = node.targets if isinstance(node, ast.Assign) else []
        for t in [*targets, *([node.target] if isinstance(node, ast.AugAssign) else [])]:
            if isinstance(t, ast.Attribute) and (
                t.attr == "__class__" or getattr(t.value, "id", None) in modules
            ):
                return True
            if isinstance(t, ast.Subscript) and getattr(t.value, "attr", "") == "__dict__":
                return getattr(t.value.value, "id", None) != "self"
        return False

    def walk(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = (
                getattr(child, "name", function) if isinstance(child, ast.FunctionDef) else function
            )
            if writes(child):
                found.add(f"{where}:{name}")
            walk(child, name)

    walk(tree, "")
    return found


def test_every_runtime_replacement_goes_through_patches_patch():
    found = set()
    for path in (ROOT / "gpu_busy").rglob("*.py"):
        if path.name != "patches.py":
            found |= _writes_onto_others(path)
    assert found - NOT_A_PATCH.keys() == set(), "use gpu_busy.patches.patch, or name why not"
    assert NOT_A_PATCH.keys() - found == set(), "gone: take it off NOT_A_PATCH"


def test_a_patch_is_undone_to_what_its_owner_held_unless_replaced_since():
    from types import SimpleNamespace

    from gpu_busy.patches import patch

    class Owner:
        def run(self) -> str:
            return "class"

    owner = Owner()
    undo = patch(owner, "run", lambda: "patched")
    assert owner.run() == "patched"
    undo()
    assert owner.run() == "class" and "run" not in vars(owner)  # the class's method again
    module = SimpleNamespace(run=lambda: "original")
    original = module.run
    undo = patch(module, "run", lambda: "ours")
    undo()
    assert module.run is original
    undo = patch(module, "run", lambda: "ours")
    theirs = module.run = lambda: "theirs"
    undo()
    assert module.run is theirs  # putting ours back would undo theirs


def test_on_a_gpu_runner_make_test_runs_the_cpu_tests_in_workers_then_the_gpu_tests_alone(
    tmp_path,
):
    """scripts/run_tests.py with the CUDA check stood in for: two pytest runs, the CPU tests
    in two workers and the GPU tests in one process, and one exit status for both. It runs
    over a suite of two tests, one of each kind, so the check costs the workers' start-up
    only."""
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    gpu: needs CUDA\n    slow: long\n"
    )
    (tmp_path / "test_kinds.py").write_text(
        "import os\nimport pytest\n\n"
        "def test_cpu():\n    assert os.environ.get('PYTEST_XDIST_WORKER')\n\n"
        "@pytest.mark.gpu\ndef test_gpu():\n    assert not os.environ.get('PYTEST_XDIST_WORKER')\n"
    )
    # without the project's pytest plugin: it imports torch in every process
    script = [sys.executable, str(ROOT / "scripts" / "run_tests.py"), "--all", "--workers", "2",
              "-p", "no:gpu_busy"]  # fmt: skip
    # not this run's own worker variables: the tests below read where they run
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["GPU_BUSY_TESTS_CUDA"] = "1"
    result = subprocess.run(script, capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=HANG_S)  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out[-3000:]
    cpu, gpu = out.split("GPU tests in one process: ")
    assert cpu.startswith("CPU tests in workers: pytest -n 2 --dist worksteal -m not gpu")
    # each test asserts where it ran: the CPU one in a worker, the GPU one in this process
    assert "created: 2/2 workers" in cpu and "1 passed" in cpu, cpu[-500:]
    assert gpu.startswith("pytest -p no:xdist -m gpu") and "workers" not in gpu, gpu[-500:]
    assert "1 passed, 1 deselected" in gpu, gpu[-500:]
    # one exit status: a failure in either run is the command's
    (tmp_path / "test_kinds.py").write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_gpu():\n    assert 0\n"
    )
    failed = subprocess.run(script, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert failed.returncode == 1, failed.stdout[-2000:]  # the CPU run had no test: 5
    assert subprocess.run([*script, "-k", "no_such_test"], capture_output=True,
                          env=env, cwd=tmp_path).returncode == 5  # fmt: skip


def test_every_test_file_is_in_one_tier_and_make_test_runs_the_users():
    """tests/tiers.py names each test file once, in the user's tier (make test) or the
    library's (make test-all adds it): a new file is placed before it runs anywhere."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from run_tests import user_tier

    from tests.tiers import LIBRARY, USER

    found = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py"))
    listed = [*USER, *LIBRARY]
    assert sorted(set(listed)) == sorted(listed), "a file in both tiers, or twice"
    assert sorted(listed) == found, (set(found) - set(listed), set(listed) - set(found))
    assert user_tier(["-q"]) == [str(ROOT / name) for name in USER]
    assert user_tier(["-q", str(ROOT / "tests" / "idle")]) == []  # a path given runs that


@pytest.mark.slow
def test_the_gpu_suite_keeps_within_its_total_and_says_what_it_did_not_run(tmp_path):
    """A total that leaves the first part (the default fit) a few seconds: it is cut at what
    the total leaves, with its line; every later part says it was not run; the required
    checks fail. A stand-in Python (SUITE_PYTHON) names no device at once and trains for
    ever, so the suite's own arithmetic is all that is timed."""
    python = tmp_path / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = - ]; then cat >/dev/null; echo "device: none (stand-in)"; exit 0; fi\n'
        'case " $* " in *" template.train "*) exec sleep 600;; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    total = 8
    env = {**os.environ, "SUITE_S": str(total), "KILL_AFTER_S": "1", "SHORTEST_PART_S": "4",
           "SUITE_PYTHON": str(python)}  # fmt: skip
    started = time.monotonic()
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_suite.sh"), str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=HANG_S)  # fmt: skip
    lines = result.stdout.splitlines()
    assert time.monotonic() - started < total + 22, result.stdout
    assert result.returncode == 1
    (first,) = [line for line in lines if line.startswith("== default_fit (at most ")]
    # the total less the start-up and the 1 s a SIGKILL may follow SIGTERM by
    limit = int(first.split("at most ")[1].split(" s)")[0])
    assert 4 <= limit <= total - 1, first
    assert f"   default_fit: not run in full (cut at {limit} s)" in lines, lines
    later = ("gpu_tests", "host_cost", "end_to_end", "checkpoints", "bench_rest", "step_costs")
    for name in later:
        assert f"== {name}: not run (the suite's {total} s were spent)" in lines, (name, lines)
    assert lines[-2].startswith("required GPU checks: 0 run, 7 skipped"), lines[-3:]
