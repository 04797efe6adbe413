"""jsonargparse's and Lightning's errors as one line a user can act on, found from the
errors' objects and frames, and from the settings the user gave, not from their English.

Example::

    except ArgumentError as e:
        print(f"error: {argument_error_line(e, args)}")
"""

from __future__ import annotations

import inspect
import os
import re
import types
import typing

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI

from gpu_busy import lightning_compat as compat
from gpu_busy.cli.keys import given_settings, subcommand_in
from gpu_busy.config_files import CLASS_GROUPS, import_class, named_class_path


def argument_error_line(error: BaseException, args: list[str]) -> str:
    """jsonargparse's refusal of a value as one line: the setting the user gave whose value
    its innermost error quotes (the check that failed), else its whole message quotes,
    where exactly one does; with the first line of the message that quotes that value.
    Otherwise its whole message, on one line."""
    subcommand = subcommand_in(args, LightningCLI.subcommands())
    settings = [
        (key, where, str(value))
        for key, where, value in given_settings(args, subcommand)
        if isinstance(value, str | int | float) and not isinstance(value, bool)
    ]
    lines = [line.strip(" -") for line in str(error).splitlines()]
    refused = _refused_key(str(error))
    named = [s for s in settings if s[0] == refused]
    if refused and named:
        key, where, value = named[-1]  # the last one given is the one parsed
        expected = expected_type(key, args[args.index(subcommand) + 1 :] if subcommand else [])
        if expected:
            return f"{where}: {key}={value}: expected {expected}"
    for text in (str(innermost(error)), str(error)):
        quoted = [s for s in settings if _quotes(text, s[2])]
        if len(quoted) == 1:
            key, where, value = quoted[0]
            line = next((x for x in lines if _quotes(x, value)), text)
            return f"{where}: {key}={value}: {line}"
    return " ".join(str(error).split())


def _refused_key(message: str) -> str | None:
    """The setting jsonargparse refused, by the keys its message names in order: an outer
    key (``trainer.max_epochs``, or a class group, ``data``) and, inside a class, the
    argument (``dataset``): ``data.dataset``."""
    keys = re.findall(r'Parser key "([^"]+)"', message)
    if not keys:
        return None
    outer, inner = keys[0], keys[-1]
    return f"{outer}.{inner}" if outer in CLASS_GROUPS and len(keys) > 1 else outer


def expected_type(key: str, args: list[str]) -> str | None:
    """What ``key`` takes, from the signature it is an argument of (``Trainer``'s, or the
    class its group names), in the words of a config file: ``int or null``, ``one of
    synthetic, cifar10, folder``. None where the key is not a plain argument."""
    group, _, name = key.partition(".")
    path = named_class_path(group, args) if group in CLASS_GROUPS else None
    try:
        owner = pl.Trainer if group == "trainer" else import_class(path) if path else None
        hints = typing.get_type_hints(owner.__init__) if owner else {}
    except Exception:  # a class that cannot be imported or resolved: jsonargparse's line
        return None
    if name not in hints or name not in inspect.signature(owner.__init__).parameters:
        return None
    return _type_words(hints[name])


def _type_words(annotation) -> str:
    kinds, choices = [], []

    def walk(t) -> None:
        origin = typing.get_origin(t)
        if origin in (typing.Union, types.UnionType):
            for arg in typing.get_args(t):
                walk(arg)
        elif origin is typing.Literal:
            choices.extend(str(v) for v in typing.get_args(t) if str(v) not in choices)
        elif t is type(None):
            kinds.append("null")
        else:
            kinds.append(getattr(t, "__name__", str(t)))

    walk(annotation)
    words = ([f"one of {', '.join(choices)}"] if choices else []) + [
        k for k in kinds if k != "null"
    ]
    return " or ".join(words + ["null"] * ("null" in kinds))


def _quotes(text: str, value: str) -> bool:
    return bool(value) and re.search(rf"(?<![\w.]){re.escape(value)}(?![\w.])", text) is not None


def innermost(error: BaseException) -> BaseException:
    """The first error of the chain that ends in ``error``."""
    while error.__cause__ or error.__context__:
        error = error.__cause__ or error.__context__
    return error


def raised_outside(error: BaseException | None, package: str) -> BaseException | None:
    """The outermost error of ``error``'s chain whose innermost frame is not in ``package``
    (an error a class raised, that jsonargparse wrapped), or None."""
    while error is not None:
        where = _innermost_file(error)
        if where and f"{os.sep}{package}{os.sep}" not in where:
            return error
        error = error.__cause__ or error.__context__
    return None


def raised_choosing_devices(error: BaseException) -> bool:
    """Whether Lightning refused ``error`` while choosing the accelerator and devices."""
    return compat.chooses_devices(_innermost_file(error))


def devices_line(error: BaseException, accelerator: object, devices: object) -> str:
    """Lightning's refusal of the device settings, with what this machine has and the
    command that fits it."""
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = "`make train GPUS=N` for N of them, " if found else "`make train` (the CPU), "
    refused = " ".join(str(error).split())  # Lightning's own message, all its lines
    return (
        f"trainer.accelerator={accelerator} trainer.devices={devices}: {refused} "
        f"(this machine has {found} GPU(s)); run {gpus}or `make train ACCELERATOR=cpu "
        "DEVICES=N` for N-process DDP on the CPU"
    )


def _innermost_file(error: BaseException) -> str:
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename if tb is not None else ""


def raised_in_restore(error: BaseException) -> bool:
    """Whether ``error`` came out of Lightning's restore of a checkpoint's training state."""
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if compat.restores_a_checkpoint(code.co_filename, code.co_name):
            return True
        tb = tb.tb_next
    return False


def raised_by_lightning(error: BaseException) -> bool:
    """Whether the innermost frame of ``error`` is Lightning's own code."""
    return compat.is_lightning_file(_innermost_file(error))


def cause_of(error: BaseException | None, kind: type | tuple[type, ...]) -> BaseException | None:
    while error is not None and not isinstance(error, kind):
        error = error.__cause__ or error.__context__
    return error


# Printed on every run by the libraries, with nothing for a user to change: torch's
