"""The config files on a command line, checked with nothing heavier than a YAML parser.

An entry point (``template/train.py``) runs ``check_config_files`` before it imports torch
and Lightning (about 10 s), so a broken file is one line at once; ``class_sections`` and
``close_match`` let the command line name the file and the likely key of a setting it
refuses (``gpu_busy.cli.keys``).

Example::

    check_config_files(["fit", "--config", "configs/default.yaml"])   # UserError if broken
    class_sections("model", args)   # (file, the class it was set for, {name: value}), ...
    close_match("max_epoch", ["max_epochs", "min_epochs"])   # "max_epochs"
"""

from __future__ import annotations

import difflib
import functools
import importlib
import pkgutil
from collections.abc import Iterable, Iterator
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


# The groups a config names a class for (LightningCLI's subclass mode).
CLASS_GROUPS = ("model", "data")


def import_class(path: str) -> type:
    """The class a dotted ``class_path`` names."""
    module, _, name = str(path).rpartition(".")
    return getattr(importlib.import_module(module), name)


def check_config_files(args: list[str]) -> None:
    """Each ``--config`` file must parse as YAML; jsonargparse's own error does not say which
    of several files it is in."""
    for file in config_files(args, existing=False):
        _check_config_file(file)
    for group in CLASS_GROUPS:
        path = named_class_path(group, args)
        problem = path and class_path_problem(path)
        if problem:
            raise UserError(f"{group}.class_path {path}: {problem}")


def _check_config_file(file: Path) -> None:
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
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or " ".join(str(e).split())
        raise UserError(f"{file}{where}: {problem}; fix the YAML there") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read config {file}: {e}") from None
    if loaded is not None and not isinstance(loaded, dict):
        shown = " ".join(str(loaded).split())
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise UserError(
            f"{file} holds {type(loaded).__name__} {shown!r}, not settings: a config file "
            "maps keys to values (trainer:, model:, data:); see configs/default.yaml"
        )


def read_settings(file: Path) -> object:
    """A config file's settings, parsed once while the file stays as it is: the command
    line asks for them a dozen times (each key's origin, each group's class), and a parse
    is about 20 ms with PyYAML's pure-Python loader. Shared: do not change what it returns."""
    stat = file.stat()
    return _parsed(str(file), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _parsed(path: str, mtime_ns: int, size: int) -> object:
    return yaml.load(Path(path).read_text(), Loader=_LOADER)


# libyaml's loader where PyYAML was built with it (its wheels are): the same documents.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def group_sections(group: str, args: list[str]) -> Iterator[tuple[Path, object]]:
    """Each ``--config`` file with its section for ``group`` ("model", "data"), in order; a
    file that does not parse is left out (``check_config_files`` has said so)."""
    for file in config_files(args):
        try:
            section = (read_settings(file) or {}).get(group)
        except (OSError, yaml.YAMLError, AttributeError):
            continue
        yield file, section


def class_sections(group: str, args: list[str]) -> Iterator[tuple[Path, str | None, dict]]:
    """Each ``--config`` file's settings for ``group``'s class, with the class they were set
    for: the file's ``class_path``, else the last one an earlier file named (None before
    any). ``init_args`` and settings given beside ``class_path`` alike."""
    current = None
    for file, section in group_sections(group, args):
        if isinstance(section, str):  # model: my.Model
            current = section
        if not isinstance(section, dict):
            continue
        current = section.get("class_path", current)
        init = section.get("init_args")
        own = {k: v for k, v in section.items() if k not in ("class_path", "init_args")}
        yield file, current, {**own, **(init if isinstance(init, dict) else {})}


def named_class_path(group: str, args: list[str]) -> str | None:
    """The class ``group`` ends up with: the command line's class_path, else the last
    config file's that names one."""
    path = None
    for _, current, _ in class_sections(group, args):
        path = current
    for arg in args:
        for prefix in (f"--{group}.class_path=", f"--{group}="):
            if arg.startswith(prefix):
                path = arg[len(prefix) :]
    return path if isinstance(path, str) and "." in path and path not in ("null", "None") else None


def class_path_problem(path: str) -> str | None:
    """Why ``path`` names no class, with the closest name that exists; None where it does
    (or where the module fails for a reason of its own: jsonargparse reports that)."""
    module_name, _, name = path.rpartition(".")
    parts = module_name.split(".")
    for depth in range(len(parts), 0, -1):
        prefix = ".".join(parts[:depth])
        try:
            module = importlib.import_module(prefix)
        except ModuleNotFoundError as e:
            if e.name is not None and not prefix.startswith(e.name):
                return None  # the module imports a package that is missing: its own error
            continue
        except Exception:
            return None
        if depth == len(parts):
            return _missing_class(module, module_name, name)
        return _missing_module(module, parts, depth, name)
    # Among every installed top-level name only a near twin is a likely meaning.
    near = close_match(parts[0], [m.name for m in pkgutil.iter_modules()], cutoff=0.8)
    if near:
        return f"no module named {parts[0]}; did you mean {'.'.join([near, *parts[1:], name])}?"
    return (
        f"no module named {parts[0]}: a package of your own is found in the folder you run "
        f"from (the project root, for make train: {parts[0]}/ with an __init__.py), where "
        "`pip install -e` put it, or on PYTHONPATH"
    )


def _missing_class(module: object, module_name: str, name: str) -> str | None:
    if hasattr(module, name):
        return None
    names = [n for n, v in vars(module).items() if isinstance(v, type)]
    near = close_match(name, names)
    hint = f"; did you mean {module_name}.{near}?" if near else ""
    return f"module {module_name} has no {name}{hint}"


def _missing_module(package: object, parts: list[str], depth: int, name: str) -> str:
    """``parts[depth]`` is not a module of ``package`` (``parts[:depth]``)."""
    missing = parts[depth]
    found = getattr(package, "__path__", None)
    subs = [m.name for m in pkgutil.iter_modules(found)] if found else []
    near = close_match(missing, subs)
    fixed = ".".join([*parts[:depth], near, *parts[depth + 1 :], name]) if near else None
    hint = f"; did you mean {fixed}?" if fixed else ""
    return f"no module named {'.'.join(parts[: depth + 1])}{hint}"


def close_match(name: str, choices: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The accepted name closest to a misspelt one, if one is close."""
    found = difflib.get_close_matches(name, sorted(set(choices)), n=1, cutoff=cutoff)
    return found[0] if found else None
