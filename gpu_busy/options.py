"""``Options``: what a run can choose of the default set, declared once.

Each field is one option everywhere: ``gpu_busy.<field>`` in a ``make train`` config
(``--gpu_busy.<field>=...``), ``--<field>`` on ``python -m gpu_busy run`` (``--no-<field>``
for a setting that is on by default), and ``GPU_BUSY_<...>`` in the environment, which
carries the launcher's options to every rank. The launcher's parser and help, the
command line's ``gpu_busy:`` section and GUIDE's table are made from the fields. A value
given in code or a config wins over the environment, which wins over the default.

Example::

    Options.resolved(monitor="val/acc")        # strict from GPU_BUSY_STRICT_SYNCS, if set
    for name, f in fields_of():
        print(launcher_flag(f), variable(f), f.metadata["help"])
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gpu_busy.errors import UserError

_ON, _OFF = ("1", "true", "yes"), ("0", "false", "no")


def _option(default: Any, variable: str, help: str, value: str = "") -> Any:
    """A field of ``Options``: its environment variable, its help, and the word for its
    value in the launcher's usage (none for a switch)."""
    return dataclasses.field(
        default=default, metadata={"variable": variable, "help": help, "value": value}
    )


@dataclass(frozen=True)
class Options:
    """What a run can choose of the default set; the help of each field is its metadata's."""

    monitor: str | None = _option(
        None,
        "GPU_BUSY_MONITOR",
        "the metric of the best checkpoint (last.ckpt beside it); unset: Lightning's own",
        "NAME",
    )
    mode: Literal["max", "min"] = _option(
        "max", "GPU_BUSY_MODE", "which way monitor is better", "max|min"
    )
    prefetch: bool = _option(
        True, "GPU_BUSY_PREFETCH", "copy the next batch to the GPU on a side stream"
    )
    strict: bool = _option(
        False,
        "GPU_BUSY_STRICT_SYNCS",
        "exit 1 at the first steady sync, naming its line",
    )
    peer_timeout: float = _option(
        30.0,
        "GPU_BUSY_PEER_TIMEOUT",
        "DDP: seconds of a rank's silence before the others stop",
        "SECONDS",
    )
    rank_wait: float = _option(
        60.0,
        "GPU_BUSY_RANK_WAIT",
        "DDP: seconds a rank waits at set-up for the others' set",
        "SECONDS",
    )
    stop_wait: float = _option(
        20.0,
        "GPU_BUSY_STOP_WAIT",
        "seconds a stop waits for a batch's end (where a fit saves); then it stops unsaved",
        "SECONDS",
    )
    resume: bool = _option(
        False,
        "GPU_BUSY_RESUME",
        "the first fit without a ckpt_path resumes from the newest last.ckpt",
    )

    @classmethod
    def resolved(cls, environ: Mapping[str, str] | None = None, **given: Any) -> Options:
        """The options ``given`` (in code, a config), the environment's for the others,
        and the defaults for the rest. A bad value in the environment is a ``UserError``."""
        return cls(**{**from_environment(environ), **given})


def fields_of() -> Iterator[tuple[str, dataclasses.Field]]:
    """Each option's name and field, in the order declared."""
    for f in dataclasses.fields(Options):
        yield f.name, f


def types() -> dict[str, Any]:
    """Each option's type (the annotations, evaluated)."""
    return typing.get_type_hints(Options)


def is_switch(f: dataclasses.Field) -> bool:
    return types()[f.name] is bool


def variable(f: dataclasses.Field) -> str:
    return f.metadata["variable"]


def yaml_key(f: dataclasses.Field) -> str:
    return f"gpu_busy.{f.name}"


def launcher_flag(f: dataclasses.Field) -> str:
    """``--strict`` for a switch that is off by default, ``--no-prefetch`` for one that is
    on, ``--peer-timeout SECONDS`` for a value."""
    name = f.name.replace("_", "-")
    if is_switch(f):
        return f"--no-{name}" if f.default else f"--{name}"
    return f"--{name} {f.metadata['value']}"


def flag_of(name: str) -> str:
    """The launcher's flag for the option ``name``, without its value: ``--resume``."""
    return launcher_flag(next(f for n, f in fields_of() if n == name)).split()[0]


def switched(f: dataclasses.Field) -> str:
    """The variable's value that the launcher's switch sets."""
    return "0" if f.default else "1"


def parse(f: dataclasses.Field, text: str, said_as: str) -> Any:
    """``text`` as the option's value; a ``UserError`` naming ``said_as`` (the variable or
    the flag) where it is not one."""
    kind, value = types()[f.name], text.strip()
    if kind is bool:
        if value.lower() in _ON + _OFF:
            return value.lower() in _ON
        raise UserError(f"{said_as}={text!r}: give 1 (on) or 0 (off)")
    if kind is float:
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if number > 0:
            return number
        raise UserError(f"{said_as}={text!r}: give a number of seconds above 0")
    if choices := typing.get_args(kind) if typing.get_origin(kind) is Literal else ():
        if value in choices:
            return value
        raise UserError(f"{said_as}={text!r}: give {' or '.join(choices)}")
    return value or None  # a name; empty is none


def from_environment(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The options the environment sets (``GPU_BUSY_*``), typed and checked."""
    environ = os.environ if environ is None else environ
    return {
        name: parse(f, environ[variable(f)], variable(f))
        for name, f in fields_of()
        if environ.get(variable(f), "").strip()
    }


def guide_table() -> str:
    """The options table of docs/GUIDE.md, as it must read there."""
    rows = ["| `gpu_busy:` key | launcher flag | environment variable | default | what it does |",
            "|---|---|---|---|---|"]  # fmt: skip
    for _, f in fields_of():
        flag, said = (text.replace("|", "\\|") for text in (launcher_flag(f), f.metadata["help"]))
        rows.append(f"| `{f.name}` | `{flag}` | `{variable(f)}` | `{f.default}` | {said} |")
    return "\n".join(rows)
