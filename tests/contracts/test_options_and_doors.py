"""Each option is declared once (``gpu_busy.options``): the launcher's parser and help, the
command line's ``gpu_busy:`` keys, the variables that travel to the ranks and GUIDE's
table are made from it, and no other file holds a copy. The example imports only the
public ``gpu_busy``."""

from __future__ import annotations

import ast
import re

import pytest
import yaml

from gpu_busy import launcher
from gpu_busy import options as opts
from tests.conftest import ROOT, cli_main

NAMES = [name for name, _ in opts.fields_of()]


def test_the_launchers_help_and_parser_are_the_declaration(capsys):
    with pytest.raises(SystemExit):
        launcher.main(["run", "--help"])
    shown = capsys.readouterr().out
    for _, f in opts.fields_of():
        flag, variable = opts.launcher_flag(f), opts.variable(f)
        assert f"{flag}" in shown and variable in shown and f.metadata["help"][:40] in shown
        # each flag sets its variable, as every rank reads it
        value = {bool: [], float: ["5"]}.get(opts.types()[f.name], ["x"])
        if f.name == "mode":
            value = ["min"]
        env, *_ = launcher._parse(["run", flag.split()[0], *value, __file__])
        assert list(env) == [variable]
        assert opts.Options.resolved(env).__dict__[f.name] != f.default or f.name == "monitor"


def test_every_option_is_a_key_of_the_command_line_with_the_environments_default(
    capsys, monkeypatch
):
    monkeypatch.setenv("GPU_BUSY_STOP_WAIT", "7")
    with pytest.raises(SystemExit):
        cli_main()(["fit", "--config", str(ROOT / "configs" / "default.yaml"), "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)["gpu_busy"]
    assert sorted(printed) == sorted(NAMES)
    assert printed["stop_wait"] == 7.0 and printed["monitor"] == "val/acc"  # the config's


def test_guide_holds_the_table_made_from_the_declaration():
    assert opts.guide_table() in (ROOT / "docs" / "GUIDE.md").read_text()


def test_no_other_file_holds_a_copy_of_an_option():
    """A variable's name, or a launcher flag's, appears in code only in options.py; the
    configs set no option to its default."""
    variables = {opts.variable(f) for _, f in opts.fields_of()}
    flags = {opts.launcher_flag(f).split()[0] for _, f in opts.fields_of()}
    copies = []
    for path in [*ROOT.glob("gpu_busy/**/*.py"), *ROOT.glob("template/**/*.py"),
                 *ROOT.glob("scripts/*"), *ROOT.glob("bench/*.py"), ROOT / "Makefile"]:  # fmt: skip
        if path.name == "options.py" or not path.is_file():
            continue
        text = path.read_text()
        copies += [f"{path.name}: {v}" for v in variables if v in text]
        copies += [f"{path.name}: {flag}" for flag in flags
                   if re.search(rf"[\"']{re.escape(flag)}[\"' =]", text)]  # fmt: skip
    assert copies == []
    defaults = {name: f.default for name, f in opts.fields_of()}
    for config in ROOT.glob("configs/*.yaml"):
        section = (yaml.safe_load(config.read_text()) or {}).get("gpu_busy") or {}
        assert [k for k, v in section.items() if defaults.get(k) == v] == [], config.name


def test_a_bad_value_in_the_environment_is_one_line_naming_it():
    with pytest.raises(opts.UserError, match=r"GPU_BUSY_STOP_WAIT='soon': give a number"):
        opts.Options.resolved({"GPU_BUSY_STOP_WAIT": "soon"})
    with pytest.raises(opts.UserError, match=r"GPU_BUSY_STRICT_SYNCS='maybe': give 1"):
        opts.Options.resolved({"GPU_BUSY_STRICT_SYNCS": "maybe"})
    assert opts.Options.resolved({"GPU_BUSY_STRICT_SYNCS": "1"}, strict=False).strict is False


def test_the_example_imports_only_the_public_gpu_busy():
    """``template/`` is the user's side: no door to Lightning's privates, no private name."""
    private = []
    for path in ROOT.glob("template/**/*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpu_busy"):
                names = [node.module, *(a.name for a in node.names)]
                if "lightning_compat" in node.module or any(
                    part.startswith("_") for n in names for part in n.split(".")
                ):
                    private.append(f"{path.relative_to(ROOT)}: from {node.module} import ...")
    assert private == []
