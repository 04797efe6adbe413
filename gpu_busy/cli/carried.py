"""Settings the config files made for another class than the one a run ends up with."""

from __future__ import annotations

import inspect

from jsonargparse import Namespace

from gpu_busy.cli.keys import command_line_settings
from gpu_busy.config_files import class_sections, import_class
from gpu_busy.errors import UserError


def leave_out_carried(group: str, final: object, args: list[str]) -> str | None:
    """Give ``group``'s class its own defaults for the settings the config files made for
    another class (``carried_settings``); the line that says which, or None.

    A subclass of the class they were set for keeps them: they mean to it what they mean
    to its base. A carried setting the class requires (no default) stops the run.
    """
    carried = carried_settings(group, final, args)
    if not carried:
        return None
    path = final.class_path
    carried = {k: (v, owner) for k, (v, owner) in carried.items() if not _subclass_of(path, owner)}
    if not carried:
        return None
    try:
        parameters = inspect.signature(import_class(path)).parameters
    except (TypeError, ValueError, ImportError, AttributeError):
        parameters = {}
    # Where the class's own default is the carried value, nothing changes: nothing to say.
    carried = {
        k: (v, owner) for k, (v, owner) in carried.items()
        if k not in parameters or not _same(parameters[k].default, v)
    }  # fmt: skip
    if not carried:
        return None
    own = []
    for name in carried:
        default = getattr(parameters.get(name), "default", None)
        if default is inspect.Parameter.empty:
            value, owner = carried[name]
            raise UserError(
                f"{group}: {path} needs {name}, which the config files set only for {owner} "
                f"({name}={value!r}); pass --{group}.{name}=<value>"
            )
        if name in parameters:
            final.init_args[name] = default
            own.append(f"{name}={default!r}")
        else:  # taken through **kwargs: the default is the one the class passes on
            del final.init_args[name]
            own.append(f"{name} (its default)")
    owners = " and ".join(sorted({owner for _, owner in carried.values()}))
    given = ", ".join(f"{k}={v!r}" for k, (v, _) in carried.items())
    return (
        f"{group}: {path} does not take {given} from the config files (set there for "
        f"{owners}); it trains with its own {', '.join(own)}; pass --{group}.<name>=<value> "
        "to choose"
    )


def _same(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:  # a value that cannot say (an array): not the same
        return False


def carried_settings(group: str, final: object, args: list[str]) -> dict[str, tuple]:
    """The ``init_args`` of ``group`` ("model", "data") that reach its class only because a
    config file set them for another class: ``{name: (value, that class)}``.

    jsonargparse keeps the ``init_args`` a new ``class_path`` also accepts, so swapping in
    your own model on the command line hands it the example's learning rate. A value
    counts as carried when a ``--config`` file set it while another class was in effect
    there, the final config holds that same value, and the command line did not set it.
    """
    if not isinstance(final, Namespace) or not final.get("class_path"):
        return {}
    given = {
        key.split(".", 1)[1]
        for key, _, _ in command_line_settings(args)
        if key.startswith(f"{group}.")
    }
    values = final.get("init_args") or Namespace()
    carried: dict[str, tuple] = {}
    for _, current, settings in class_sections(group, args):
        if current is None or current == final.class_path:
            continue
        for name, value in settings.items():
            if name not in given and name in values and values.get(name) == value:
                carried[name] = (value, current)
    return carried


def _subclass_of(path: str, base: str) -> bool:
    try:
        return issubclass(import_class(path), import_class(base))
    except Exception:  # not importable here: jsonargparse says so, or it is not a class
        return False
