"""Every key a run is given, checked against what the command accepts before jsonargparse
parses it.

jsonargparse says "not accepted" in English that changes between its releases, and 4.39
took ``--trainer.max_epoch`` for ``max_epochs`` whatever ``allow_abbrev`` said. The names
accepted here come from structure instead: the subcommand parser's own defaults
(``get_defaults``) and the signature of the class ``model`` and ``data`` name.

Example::

    line = unknown_key(parser, ["fit", "--trainer.max_epoch=1"], "fit")
    # "the command line: trainer.max_epoch is not an option; did you mean trainer.max_epochs?"
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import yaml

from gpu_busy.config_files import (
    CLASS_GROUPS,
    class_sections,
    close_match,
    config_files,
    import_class,
    named_class_path,
    read_settings,
)
from gpu_busy.errors import UserError

# Options of the parser that are not settings of the run (nor is a class's --<key>.help).
NOT_SETTINGS = frozenset({"config", "help", "print_config"})
# What a class given by path takes besides its own arguments.
SUBCLASS_KEYS = frozenset({"class_path", "init_args", "dict_kwargs"})


class KeyNotAccepted(UserError):
    """A key the command does not take, with where it was set and the one likely meant."""


def given_settings(args: list[str], subcommand: str | None) -> Iterator[tuple[str, str, object]]:
    """``(key, where, value)`` for every setting after the subcommand: each ``--config``
    file's (in order), then the command line's. ``init_args`` levels are left out of the
    key; a class group's settings made while a config file named another class are left
    out too (they are carried settings: ``carried.leave_out_carried`` decides those)."""
    tail = _after(args, subcommand)
    for file in config_files(tail):
        try:
            tree = read_settings(file)
        except (OSError, yaml.YAMLError):
            continue  # check_config_files has said so
        for key, value in _tree_settings(tree):
            yield key, str(file), value
    for group in CLASS_GROUPS:
        final = named_class_path(group, tail)
        for file, current, settings in class_sections(group, tail):
            if current in (None, final):
                yield from ((f"{group}.{name}", str(file), v) for name, v in settings.items())
    yield from command_line_settings(tail)


def subcommand_in(args: list, names) -> str | None:
    """The first argument that is one of ``names`` (the subcommands), or None."""
    return next((a for a in args if isinstance(a, str) and a in names), None)


def _after(args: list[str], subcommand: str | None) -> list[str]:
    return args[args.index(subcommand) + 1 :] if subcommand in args else []


def command_line_settings(tail: list[str]) -> Iterator[tuple[str, str, object]]:
    """``(key, "the command line", value)`` for each ``--key=value`` / ``--key value``."""
    for i, token in enumerate(tail):
        if not token.startswith("--"):
            continue
        name, has_value, value = token[2:].partition("=")
        name = name.rstrip("+")  # --trainer.callbacks+=...: appended
        if not has_value:
            following = tail[i + 1] if i + 1 < len(tail) else None
            value = following if following and not following.startswith("--") else None
        if name.split(".")[0] not in NOT_SETTINGS and not name.endswith(".help"):
            yield name.replace(".init_args.", "."), "the command line", value


def _tree_settings(tree: object) -> Iterator[tuple[str, object]]:
    """A config file's sections, and the trainer's settings (its class groups' are
    ``class_sections``')."""
    if not isinstance(tree, dict):
        return
    for top, section in tree.items():
        yield str(top), section
        if top == "trainer" and isinstance(section, dict):
            yield from ((f"trainer.{name}", value) for name, value in section.items())


def unknown_key(parser, args: list[str], subcommand: str) -> KeyNotAccepted | None:
    """The first setting ``parser`` (the subcommand's) does not take, as the error to raise;
    None where every one is taken or cannot be told here (jsonargparse then decides)."""
    try:
        defaults = list(parser.get_defaults().keys())
    except Exception:  # a parser that cannot give its defaults: leave it to jsonargparse
        return None
    accepted = {"": {k.split(".")[0] for k in defaults}}
    accepted["trainer"] = {k.split(".")[1] for k in defaults if k.startswith("trainer.")}
    tail = _after(args, subcommand)
    for group in CLASS_GROUPS:
        accepted[group] = _init_names(named_class_path(group, tail))
    for key, where, value in given_settings(args, subcommand):
        parts = key.split(".")
        for depth, part in enumerate(parts):
            names = accepted.get(".".join(parts[:depth]))
            if names is None:
                break  # deeper than this is checked where the class is built
            if part in names:
                continue
            # A misspelt section of a file is named with its first key: modle.lr
            rest = [*parts[depth + 1 :]] or (
                [str(next(iter(value)))] if value and isinstance(value, dict) else []
            )
            near = close_match(part, names)
            meant = f"; did you mean {'.'.join([*parts[:depth], near, *rest])}?" if near else ""
            return KeyNotAccepted(
                f"{where}: {'.'.join([*parts[: depth + 1], *rest])} is not an option{meant}"
            )
    return None


def _init_names(class_path: str | None) -> set[str] | None:
    """The arguments a class takes by name; None where any name may be right (it takes
    ``**kwargs``, or it does not import here: jsonargparse says why)."""
    if class_path is None:
        return None
    try:
        parameters = inspect.signature(import_class(class_path)).parameters.values()
    except Exception:
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return SUBCLASS_KEYS | {p.name for p in parameters if p.kind is not p.VAR_POSITIONAL}
