"""The config files on a command line, checked with nothing heavier than a YAML parser.

An entry point (``template/train.py``) runs ``check_config_files`` before it imports torch
and Lightning (about 10 s), so a broken file is one line at once; ``key_origin`` and
``close_match`` turn jsonargparse's "option not accepted" into a line that names the file
and the likely key (``gpu_busy.cli``).

Example::

    check_config_files(["fit", "--config", "configs/default.yaml"])   # UserError if broken
    key_origin("trainer.max_epoch", args)   # "configs/mine.yaml", or "the command line"
    close_match("max_epoch", ["max_epochs", "min_epochs"])   # "max_epochs"
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path

import yaml

from gpu_busy.errors import UserError


def config_files(args: list[str], existing: bool = True) -> list[Path]:
    """The ``--config`` files on a command line, in order (``existing``: those that are)."""
    files = []
    for i, arg in enumerate(args):
        if arg in ("--config", "-c") and i + 1 < len(args):
            files.append(Path(args[i + 1]).expanduser())
        elif arg.startswith("--config="):
            files.append(Path(arg.split("=", 1)[1]).expanduser())
    return [f for f in files if f.is_file() or not existing]


# A config holds hundreds of values; YAML aliases can make a few lines expand to billions
# (an "alias bomb"), which the parsers would build in memory.
MAX_CONFIG_VALUES = 100_000


def _expanded_size(root: yaml.Node | None) -> int:
    """How many values a composed YAML document holds once its aliases are expanded,
    counted without expanding them (an alias is the same node object, counted once per
    use); past ``MAX_CONFIG_VALUES`` the count stops."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node, depth: int) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if depth > 100:  # nesting this deep (or an alias that contains itself)
            return MAX_CONFIG_VALUES + 1
        total = 1
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        else:
            children = []
        for child in children:
            total += size(child, depth + 1)
            if total > MAX_CONFIG_VALUES:
                break
        sizes[id(node)] = total
        return total

    return 0 if root is None else size(root, 0)


def check_config_files(args: list[str]) -> None:
    """Each ``--config`` file must parse as YAML; jsonargparse's own error does not say which
    of several files it is in."""
    for file in config_files(args, existing=False):
        if not file.is_file():
            folder = file.parent
            there = sorted(p.name for p in folder.glob("*.yaml")) if folder.is_dir() else []
            choices = f" ({folder} has {', '.join(there)})" if there else ""
            raise UserError(f"config file {file}: File does not exist{choices}")
        try:
            text = file.read_text()
            values = _expanded_size(yaml.compose(text, Loader=yaml.SafeLoader))
            if values > MAX_CONFIG_VALUES:
                raise UserError(
                    f"{file} expands to more than {MAX_CONFIG_VALUES:,} values through YAML "
                    "aliases (*name); write the config out, or alias less"
                )
            yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f", line {mark.line + 1} column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or " ".join(str(e).split())
            raise UserError(f"{file}{where}: {problem}; fix the YAML there") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read config {file}: {e}") from None


def _dotted_keys(tree: object, prefix: str = "") -> Iterable[str]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            path = f"{prefix}{key}"
            yield path
            yield from _dotted_keys(value, f"{path}.")


def key_origin(key: str, args: list[str]) -> str | None:
    """Which config file sets the dotted ``key`` (``init_args`` levels ignored), the last
    one that does; "the command line" for ``--key``; None when neither is found."""

    def plain(k: str) -> str:
        return k.replace(".init_args.", ".")

    wanted = plain(key)
    if any(a.split("=", 1)[0].lstrip("-").replace(".init_args.", ".") == wanted for a in args):
        return "the command line"
    found = None
    for file in config_files(args):
        try:
            tree = yaml.safe_load(file.read_text())
        except (OSError, yaml.YAMLError):
            continue
        if any(plain(k) == wanted for k in _dotted_keys(tree)):
            found = str(file)
    return found


def close_match(name: str, choices: Iterable[str]) -> str | None:
    """The accepted name closest to a misspelt one, if one is close."""
    found = difflib.get_close_matches(name, sorted(set(choices)), n=1, cutoff=0.6)
    return found[0] if found else None
