"""``python -m gpu_busy run SCRIPT [ARGS...]``: any Lightning script, unchanged, with the
default set on every Trainer it makes.

The script runs as ``__main__`` with its own arguments; every ``lightning.pytorch.Trainer``
it builds (``LightningCLI``'s too) gets ``gpu_busy.defaults()`` by the rule of
``gpu_busy.callbacks.default_set.complete``: a kind the script already passes (its progress bar,
``ModelCheckpoint``, checkpoint IO) stays. Its output, its errors and its exit code are
its own. Options travel to the other ranks as environment variables, which launchers
pass on whatever they do with the command line:

==================  ========================  =============================================
option              variable                  what it does
==================  ========================  =============================================
``--strict``        ``GPU_BUSY_STRICT_SYNCS``  exit 1 at the first steady sync, with its line
``--monitor NAME``  ``GPU_BUSY_MONITOR``       best checkpoint by NAME, and ``last.ckpt``
``--mode max|min``  ``GPU_BUSY_MODE``          for ``--monitor``
``--no-prefetch``   ``GPU_BUSY_PREFETCH=0``    no side-stream copies of the next batch
==================  ========================  =============================================

Example::

    python -m gpu_busy run train.py --epochs 3
    python -m gpu_busy run --strict -m my_project.train fit --config my.yaml
    torchrun --nproc-per-node 2 -m gpu_busy run train.py        # every rank alike
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from gpu_busy.process_exit import end_group, end_process

USAGE = (
    "usage: python -m gpu_busy run [--strict] [--monitor NAME] [--mode max|min] "
    "[--no-prefetch] (SCRIPT | -m MODULE) [ARGS...]"
)
HELP = """
Runs a Lightning script unchanged, with gpu_busy's default set on every Trainer it makes
(a kind the Trainer already has stays). Each option is also an environment variable, read
by every rank a launcher starts:
  --strict          GPU_BUSY_STRICT_SYNCS=1  exit 1 at the first steady sync, with its line
  --monitor NAME    GPU_BUSY_MONITOR=NAME    keep the best checkpoint by NAME, and last.ckpt
  --mode max|min    GPU_BUSY_MODE            for --monitor (default max)
  --no-prefetch     GPU_BUSY_PREFETCH=0      no side-stream copies of the next batch"""
VARIABLES = {
    "strict": "GPU_BUSY_STRICT_SYNCS",
    "monitor": "GPU_BUSY_MONITOR",
    "mode": "GPU_BUSY_MODE",
    "prefetch": "GPU_BUSY_PREFETCH",
}


class _Usage(Exception):
    """A mistake in the launcher's own arguments: one line, exit 2."""


def _parse(argv: list[str]) -> tuple[dict[str, str], str | None, str | None, list[str]]:
    """The launcher's options (as environment values), the script or module, and the
    arguments that are the script's own."""
    if not argv or argv[0] != "run":
        raise _Usage("say what to run: python -m gpu_busy run train.py [ARGS...]")
    args, env = argv[1:], {}
    while args and args[0].startswith("-") and args[0] != "-m":
        option = args.pop(0)
        name, _, value = option.partition("=")
        if name in ("-h", "--help"):
            print(f"{USAGE}\n{HELP}")
            raise SystemExit(0)
        if name == "--strict":
            env[VARIABLES["strict"]] = "1"
        elif name == "--no-prefetch":
            env[VARIABLES["prefetch"]] = "0"
        elif name in ("--monitor", "--mode"):
            if not value:
                if not args:
                    raise _Usage(f"{name} needs a value")
                value = args.pop(0)
            if name == "--mode" and value not in ("max", "min"):
                raise _Usage(f"--mode {value}: give max or min")
            env[VARIABLES[name[2:]]] = value
        else:
            raise _Usage(f"{option}: not an option of gpu_busy run (its script's options "
                         "go after the script)")  # fmt: skip
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


def options_from_environment() -> dict[str, Any]:
    """The default set's options the launcher's variables give (unset: the defaults)."""
    options: dict[str, Any] = {}
    if monitor := os.environ.get(VARIABLES["monitor"]):
        options["monitor"] = monitor
    if mode := os.environ.get(VARIABLES["mode"]):
        options["mode"] = mode
    if os.environ.get(VARIABLES["prefetch"], "1").strip().lower() in ("0", "false", "no"):
        options["prefetch"] = False
    return options  # strict: SyncPointDetector reads GPU_BUSY_STRICT_SYNCS itself


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
    options = options_from_environment()
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

    def undo_all() -> None:
        for u in reversed(undo):
            u()

    return undo_all


def _run(script: str | None, module: str | None, args: list[str]) -> None:
    if module is not None:
        sys.argv = [module, *args]  # runpy puts the module's file in argv[0], as python -m does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).resolve().parent)  # as `python script.py` has it
    runpy.run_path(script, run_name="__main__")


def _script_traceback(error: BaseException) -> None:
    """The traceback Python prints for the script's own error, from the script's frame on."""
    tb = error.__traceback__
    ours = (__file__, runpy.__file__, "<frozen runpy>")
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    sys.excepthook(type(error), error.with_traceback(tb), tb)  # the hook prints the error's own


def main(argv: list[str] | None = None) -> int:
    """The launcher on ``argv`` (``sys.argv``'s by default): returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        env, script, module, args = _parse(argv)
    except _Usage as e:
        print(f"error: {e}\n{USAGE}", file=sys.stderr)
        return 2
    os.environ.update(env)  # for this process and every rank it starts
    target = ["-m", module] if module is not None else [str(Path(script).resolve())]
    attached = Attached()
    undo = attach([sys.executable, "-m", "gpu_busy", "run", *target], attached)
    from gpu_busy.syncs.attribution import SyncError

    try:
        _run(script, module, args)
    except SyncError as e:
        # strict's finding, not a crash: the line and its fix, and exit 1
        print(f"error: strict sync check failed: {e}", file=sys.stderr)
        return 1
    except SystemExit as e:
        if e.code in (None, 0):
            end_group()
            if _said_nothing_attached(attached):
                raise SystemExit(1) from None
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        _script_traceback(e)
        return 1
    finally:
        undo()
    end_group()
    return 1 if _said_nothing_attached(attached) else 0


def _said_nothing_attached(attached: Attached) -> bool:
    """Says so where no Trainer got the set (rank zero speaking); True where that fails
    ``--strict``: a check that checked nothing."""
    from gpu_busy.callbacks.sync_point_detector import strict_from_environment
    from gpu_busy.log import current_rank

    line = attached.nothing_line()
    if line is None:
        return False
    strict = strict_from_environment()
    if current_rank() == 0:
        print(f"{line}{'; --strict: exit 1' if strict else ''}", file=sys.stderr)
    return strict


def command() -> NoReturn:
    """``python -m gpu_busy`` and the ``gpu-busy`` command: ``main``'s code, and a rank that
    joined a process group ends without an abort (``gpu_busy.process_exit``)."""
    end_process(main)
