"""jsonargparse's and Lightning's errors as one line a user can act on."""

from __future__ import annotations

import inspect
import os
import re

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

from gpu_busy.cli.carried import class_named
from gpu_busy.config_files import close_match, key_origin

CLI_GROUPS = ("config", "trainer", "model", "data", "seed_everything", "optimizer", "lr_scheduler")


def unknown_key_line(message: str, args: list[str]) -> str | None:
    """jsonargparse's "option not accepted" as one line: the key, where it was set (which
    config file, or the command line) and the accepted name closest to it."""
    found = re.search(r"does not accept option '([^']+)'", message) or re.search(
        r"unrecognized arguments: --([^\s=]+)", message
    )
    if found:
        key = found.group(1)
    else:
        found = re.search(r'Parser key "([^"]+)":.*?Option \'([^\']+)\' is not accepted', message,
                          flags=re.DOTALL)  # fmt: skip
        if not found:
            return None
        key = f"{found.group(1)}.init_args.{found.group(2)}"
    parts = [part for part in key.split(".") if part != "init_args"]
    origin = key_origin(key, args) or "the command line"
    subcommand = next((a for a in args if not a.startswith("-")), "fit")
    # The misspelt part is the first one its level does not accept ("modle" in modle.lr).
    match = None
    for depth, part in enumerate(parts):
        accepted = _accepted_names(parts[:depth], subcommand, args)
        if part not in accepted:
            match = close_match(part, accepted)
            if match:
                match = ".".join([*parts[:depth], match, *parts[depth + 1 :]])
            break
    suggestion = f"; did you mean {match}?" if match else ""
    return f"{origin}: {'.'.join(parts)} is not an option{suggestion}"


def _accepted_names(parent: list[str], subcommand: str, args: list[str]) -> set[str]:
    """The names accepted under ``parent`` (best effort: for a suggestion only)."""
    if not parent:
        run = getattr(pl.Trainer, subcommand, None)
        own = set(inspect.signature(run).parameters) if run else set()
        skipped = LightningCLI.subcommands().get(subcommand, set())
        return (own - {"self"} - skipped) | set(CLI_GROUPS)
    if parent == ["trainer"]:
        return set(inspect.signature(pl.Trainer.__init__).parameters) - {"self"}
    if len(parent) == 1 and parent[0] in ("model", "data"):
        try:
            cls = class_named(parent[0], args)
            return set(inspect.signature(cls.__init__).parameters) - {"self", "args", "kwargs"}
        except Exception:  # a class that does not import: no suggestion, the line stands
            return set()
    return set()


def argument_error_line(message: str) -> str:
    """jsonargparse's nested, multi-line error as one line that names the full key.

    In subclass mode a bad ``--data.batch_size`` is reported under ``Parser key "data"``,
    then ``Parser key "batch_size"``, then the reason on that line or the next.
    """
    keys = re.findall(r'Parser key "([^"]+)":', message)
    last = re.findall(r'Parser key "[^"]+":[ \t]*\n?\s*([^\n]*)', message)
    if not keys:
        return " ".join(message.split())
    key = ".".join(k for k in keys if k != "init_args")
    line = f'Parser key "{key}": {last[-1].strip()}'
    # Under a union (class_path), the reason is nested below the list of subtypes.
    problem = re.search(r"- (Problem with given class_path '[^']+'):\s*\n\s*([^\n]+)", message)
    if problem:
        line += f" ({problem.group(1)}: {problem.group(2).strip()})"
    return line


def one_line(error: BaseException) -> str:
    """An error's message on one line. Raised in a DataLoader worker, it arrives wrapped
    in the worker's traceback text, whose last line is ``module.Type: message``."""
    text = str(error).strip()
    last = text.splitlines()[-1] if text else type(error).__name__
    prefix = f"{type(error).__module__}.{type(error).__name__}: "
    return last.removeprefix(prefix)


def raised_in_restore(error: BaseException) -> bool:
    """Whether ``error`` came out of Lightning's restore of a checkpoint's training state."""
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.endswith("checkpoint_connector.py") and code.co_name.startswith(
            "restore"
        ):
            return True
        tb = tb.tb_next
    return False


def raised_by_lightning(error: BaseException) -> bool:
    """Whether the innermost frame of ``error`` is Lightning's own code."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = tb.tb_frame.f_code.co_filename if tb is not None else ""
    return f"{os.sep}lightning{os.sep}" in where and "-packages" in where


def cause_of(error: BaseException | None, kind: type | tuple[type, ...]) -> BaseException | None:
    while error is not None and not isinstance(error, kind):
        error = error.__cause__ or error.__context__
    return error


# Printed on every run by the libraries, with nothing for a user to change: torch's
