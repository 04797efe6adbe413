"""``python -m gpu_busy run SCRIPT [ARGS...]``: any Lightning script, unchanged, with the
default set on every Trainer it makes.

The script runs as ``__main__`` with its own arguments; every ``lightning.pytorch.Trainer``
it builds (``LightningCLI``'s too) gets ``gpu_busy.defaults()`` by the rule of
``gpu_busy.callbacks.default_set.complete``: a kind the script already passes (its progress bar,
``ModelCheckpoint``, checkpoint IO) stays. Its output, its errors and its exit code are
its own; how a run ends is ``gpu_busy.outcomes``' table, as under ``make train``. The
options are ``gpu_busy.options``' (``--help`` lists them); they travel to the other ranks
as environment variables, which launchers pass on whatever they do with the command line.

Example::

    python -m gpu_busy run train.py --epochs 3
    python -m gpu_busy run --strict -m my_project.train fit --config my.yaml
    python -m gpu_busy run --resume train.py --epochs 3      # after a stop: from last.ckpt
    torchrun --nproc-per-node 2 -m gpu_busy run train.py        # every rank alike
"""

from __future__ import annotations

import functools
import inspect
import os
import runpy
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from gpu_busy import options as opts
from gpu_busy import outcomes
from gpu_busy.errors import UserError
from gpu_busy.process_exit import end_process


def usage() -> str:
    flags = " ".join(f"[{opts.launcher_flag(f)}]" for _, f in opts.fields_of())
    return f"usage: python -m gpu_busy run {flags} (SCRIPT | -m MODULE) [ARGS...]"


def help_text() -> str:
    """The options with their variables and help, from ``gpu_busy.options``."""
    rows = [(opts.launcher_flag(f), opts.variable(f), f.metadata["help"])
            for _, f in opts.fields_of()]  # fmt: skip
    width = max(len(flag) for flag, _, _ in rows) + 2
    lines = [f"  {flag:<{width}}{name}: {said}" for flag, name, said in rows]
    return (
        "Runs a Lightning script unchanged, with gpu_busy's default set on every Trainer it\n"
        "makes (a kind the Trainer already has stays). Each option is also the environment\n"
        "variable named, read by every rank a launcher starts:\n" + "\n".join(lines)
    )


class _Usage(Exception):
    """A mistake in the launcher's own arguments: one line, exit 2."""


def _parse(argv: list[str]) -> tuple[dict[str, str], str | None, str | None, list[str]]:
    """The launcher's options (as environment values), the script or module, and the
    arguments that are the script's own."""
    if not argv or argv[0] != "run":
        raise _Usage("say what to run: python -m gpu_busy run train.py [ARGS...]")
    by_flag = {opts.launcher_flag(f).split()[0]: f for _, f in opts.fields_of()}
    args, env = argv[1:], {}
    while args and args[0].startswith("-") and args[0] != "-m":
        option = args.pop(0)
        name, has_value, value = option.partition("=")
        if name in ("-h", "--help"):
            print(f"{usage()}\n{help_text()}")
            raise SystemExit(0)
        f = by_flag.get(name)
        if f is None:
            raise _Usage(f"{option}: not an option of gpu_busy run (its script's options "
                         "go after the script)")  # fmt: skip
        if opts.is_switch(f):
            env[opts.variable(f)] = opts.switched(f)
            continue
        if not has_value:
            if not args:
                raise _Usage(f"{name} needs a value")
            value = args.pop(0)
        try:
            opts.parse(f, value, name)
        except UserError as e:
            raise _Usage(str(e)) from None
        env[opts.variable(f)] = value
    if args and args[0] == "-m":
        if len(args) < 2:
            raise _Usage("-m needs a module: python -m gpu_busy run -m my_project.train")
        return env, None, args[1], args[2:]
    if not args:
        raise _Usage("no script given: python -m gpu_busy run train.py [ARGS...]")
    script = args[0]
    if not Path(script).is_file():
        raise _Usage(f"{script}: no such file (give a Python script, or -m MODULE)")
    return env, script, None, args[1:]


class Attached:
    """What the launcher attached to in this process: Trainers given the set, and Fabric
    objects built (a loop it cannot see)."""

    def __init__(self) -> None:
        self.trainers = 0
        self.fabrics = 0

    def nothing_line(self) -> str | None:
        """One line saying why no Trainer got the set; None where one did."""
        if self.trainers:
            return None
        from gpu_busy import lightning_names

        if self.fabrics:
            why = (f"the script trains with Fabric ({self.fabrics} Fabric object(s)), whose loop "
                   "has no hooks to attach to; use the mechanisms in your loop "
                   "(docs/GUIDE.md, 'A Fabric or plain PyTorch loop')")  # fmt: skip
        elif (apart := lightning_names.apart()) and "pytorch_lightning" in sys.modules:
            why = f"a pytorch_lightning Trainer is not one gpu_busy knows here ({apart})"
        else:
            why = ("the script built no Lightning Trainer (a plain PyTorch loop: see "
                   "docs/GUIDE.md, 'A Fabric or plain PyTorch loop')")  # fmt: skip
        return f"gpu_busy: nothing attached, nothing measured: {why}"


def attach(launcher_argv: list[str], attached: Attached | None = None) -> Callable[[], None]:
    """From now on every Trainer this process makes gets the default set, and Lightning's
    launchers start the other ranks through ``launcher_argv``; returns the undo. ``attached``
    counts what was attached to."""
    import lightning.pytorch as pl
    from lightning.fabric import Fabric

    from gpu_busy import lightning_compat as compat
    from gpu_busy import lightning_names
    from gpu_busy.callbacks.default_set import complete
    from gpu_busy.log import get_logger
    from gpu_busy.patches import patch

    log = get_logger(__name__)
    chosen = opts.Options.resolved()
    options = {name: getattr(chosen, name) for name, _ in opts.fields_of()}
    attached = attached if attached is not None else Attached()
    original, fabric_init = pl.Trainer.__init__, Fabric.__init__

    @functools.wraps(original)
    def __init__(self: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        done = complete(kwargs.get("callbacks"), kwargs.get("plugins"), settings=kwargs,
                        **options)  # fmt: skip
        if done.added or done.left_out:  # else the set was there already (the template's)
            log.info("%s", done.line())
        original(self, *args, **{**kwargs, **done.trainer_kwargs})
        attached.trainers += 1

    @functools.wraps(fabric_init)
    def counted_fabric(self: Fabric, *args: Any, **kwargs: Any) -> None:
        fabric_init(self, *args, **kwargs)
        attached.fabrics += 1

    undo = [
        patch(pl.Trainer, "__init__", __init__),
        patch(Fabric, "__init__", counted_fabric),
        compat.children_run_through(launcher_argv),
        lightning_names.spawned_children_too(),
    ]
    if chosen.resume:
        undo.append(patch(pl.Trainer, "fit", _first_fit_resumes(pl.Trainer.fit)))

    def undo_all() -> None:
        for u in reversed(undo):
            u()

    return undo_all


def _first_fit_resumes(fit: Callable[..., Any]) -> Callable[..., Any]:
    """``Trainer.fit`` whose first call, given no ``ckpt_path``, resumes from the newest
    usable ``last.ckpt`` under the Trainer's runs (``--resume``), saying which or that there
    was none."""
    from gpu_busy.log import get_logger
    from gpu_busy.resume.last_saved import find_checkpoint, folders_of

    calls = 0

    @functools.wraps(fit)
    def resuming(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        bound = inspect.signature(fit).bind(self, *args, **kwargs)
        if calls == 1 and bound.arguments.get("ckpt_path") is None:
            root, folders = folders_of(self)
            flag = opts.flag_of("resume")
            found = find_checkpoint("last", root, folders, training=True, said_as=flag)
            log = get_logger(__name__)
            if found is None:
                log.info("gpu_busy: %s: no last.ckpt under %s; training from the start", flag, root)
            else:
                log.info("gpu_busy: %s: resuming from %s", flag, found[0])
                bound.arguments["ckpt_path"] = str(found[0])
        return fit(*bound.args, **bound.kwargs)

    return resuming


def _run(script: str | None, module: str | None, args: list[str]) -> None:
    if module is not None:
        sys.argv = [module, *args]  # runpy puts the module's file in argv[0], as python -m does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).resolve().parent)  # as `python script.py` has it
    runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    """The launcher on ``argv`` (``sys.argv``'s by default): returns the exit code, by
    ``gpu_busy.outcomes``' table."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        env, script, module, args = _parse(argv)
    except _Usage as e:
        print(f"error: {e}\n{usage()}", file=sys.stderr)
        return 2
    os.environ.update(env)  # for this process and every rank it starts
    target = ["-m", module] if module is not None else [str(Path(script).resolve())]
    attached = Attached()

    def script_run() -> int | None:
        undo = attach([sys.executable, "-m", "gpu_busy", "run", *target], attached)
        try:
            _run(script, module, args)
        except SystemExit as e:
            if e.code not in (None, 0):
                raise
        finally:
            undo()
        return 1 if _said_nothing_attached(attached) else 0

    again = shlex.join(["-m", module] if module is not None else [script]) + " ..."
    resume = f"python -m gpu_busy run {opts.flag_of('resume')} {again}"
    return outcomes.run(script_run, resume_hint=resume)


def _said_nothing_attached(attached: Attached) -> bool:
    """Says so where no Trainer got the set (rank zero speaking); True where that fails
    ``--strict``: a check that checked nothing."""
    from gpu_busy.log import current_rank

    line = attached.nothing_line()
    if line is None:
        return False
    strict = opts.Options.resolved().strict
    if current_rank() == 0:
        failed = f"; {opts.flag_of('strict')}: exit 1" if strict else ""
        print(f"{line}{failed}", file=sys.stderr)
    return strict


def command() -> NoReturn:
    """``python -m gpu_busy`` and the ``gpu-busy`` command: ``main``'s code, and a rank that
    joined a process group ends without an abort (``gpu_busy.process_exit``)."""
    end_process(main)
