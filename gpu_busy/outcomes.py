"""How a run ends, for both doors (``make train`` and ``python -m gpu_busy run``): every
outcome as one line and an exit code, the process group ended after a success, and the
process left by the exit rule (``gpu_busy.process_exit``).

==========================  ======================================  =====================
outcome                     what is printed (stderr)                exit code
==========================  ======================================  =====================
success                     nothing                                 0
the script's ``sys.exit(n)``  nothing more (it is raised on)        ``n``
strict's finding            ``error: strict sync check failed: …``  1
a setting or input refused  ``error: …`` (a ``UserError``)          2
a failed save               ``error: …`` (the file and why)         1
a stop by signal            ``stopped: …`` (rank zero alone)        128 + the signal
a stop for a failure        ``error: …`` (NaN loss, a lost rank)    the stop's own
anything else               the traceback from the user's frame     1
==========================  ======================================  =====================

A door adds only what is its own (the CLI's parser errors) through ``door_lines``.

Example::

    from gpu_busy import outcomes
    from gpu_busy.process_exit import end_process

    end_process(lambda: outcomes.run(lambda: trainer.fit(model), resume_hint="ckpt_path='last'"))
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

from gpu_busy.faults.training_stopped import TrainingStopped, set_resume_hint
from gpu_busy.process_exit import end_group, exit_code

Said = tuple[str | None, int]  # (the line, or None for none; the exit code)


def one_line(error: BaseException) -> str:
    """An error's message on one line. Raised in a DataLoader worker, it arrives wrapped
    in the worker's traceback text, whose last line is ``module.Type: message``."""
    text = str(error).strip()
    last = text.splitlines()[-1] if text else type(error).__name__
    prefix = f"{type(error).__module__}.{type(error).__name__}: "
    return last.removeprefix(prefix)


def _stopped(e: TrainingStopped) -> Said:
    from gpu_busy.log import current_rank

    # Every rank stops at the same check; rank zero says why and its code is the run's.
    # The others leave quietly with 0: Lightning's launcher ends the whole group, rank
    # zero included, when one of its ranks exits non-zero.
    if current_rank() != 0:
        return None, 0
    return f"{'error' if e.failure else 'stopped'}: {e}", e.exit_code


def _save_failed(e: BaseException) -> Said:
    return f"error: {getattr(e, 'strerror', None) or one_line(e)}", 1


def _lightning_sigterm(e: BaseException) -> Said:
    return "stopped: SIGTERM before the first batch; nothing to save", (128 + signal.SIGTERM)


@dataclass(frozen=True)
class Outcome:
    """One row: the exception that ends a run this way, and what is said for it."""

    # module:name, read from sys.modules when an error is matched: a module never imported
    # raised nothing, and the table costs no import (Lightning's, the detector's)
    kind: str
    said: Callable[[BaseException], Said]
    source: str  # who raises it


# fmt: off
OUTCOMES: tuple[Outcome, ...] = (
    Outcome("gpu_busy.faults.training_stopped:TrainingStopped", _stopped,
            "StopOnSignal, StopOnNonFiniteLoss, StopOnRankFailure"),
    Outcome("gpu_busy.syncs.attribution:SyncError",
            lambda e: (f"error: strict sync check failed: {e}", 1),
            "SyncPointDetector(strict=True): the line and its fix"),
    Outcome("gpu_busy.resume.checkpoint_file:SaveFailed", _save_failed,
            "a checkpoint write; the previous file is untouched"),
    Outcome("gpu_busy.errors:UserError", lambda e: (f"error: {one_line(e)}", 2),
            "every refusal of a setting or an input that says its fix"),
    # a SystemExit (with no code): matched before the script's own exits
    Outcome("lightning.pytorch.utilities.exceptions:SIGTERMException", _lightning_sigterm,
            "Lightning's own handler (loops/evaluation_loop.py, training_epoch_loop.py)"),
)
# fmt: on


def said_for(error: BaseException) -> Said | None:
    """The line and exit code the table gives ``error``; None: not an outcome of ours."""
    for row in OUTCOMES:
        module, _, name = row.kind.partition(":")
        loaded = sys.modules.get(module)  # never imported: cannot be what was raised
        if loaded is not None and isinstance(error, getattr(loaded, name)):
            return row.said(error)
    return None


def run(
    body: Callable[[], int | None],
    door_lines: Callable[[BaseException], Said | None] | None = None,
    resume_hint: str | None = None,
) -> int:
    """Run ``body`` and return the run's exit code, having printed its line.

    ``door_lines`` turns the errors only one door has (the CLI's parser) into lines first.
    After a success the process group ends (after a failure a rank may still be inside a
    collective); the caller leaves by ``process_exit.end_process``.
    """
    if resume_hint is not None:
        set_resume_hint(resume_hint)
    try:
        code = exit_code(body())
    except (KeyboardInterrupt, GeneratorExit):
        raise
    except BaseException as e:
        said = (door_lines(e) if door_lines else None) or said_for(e)
        if said is None and isinstance(e, SystemExit):
            # the script's own sys.exit, or a parser's --help: it stands, raised on
            if exit_code(e.code) == 0:
                end_group()
            raise
        if said is None:
            _traceback_from_the_users_frame(e)
            return 1
        line, code = said
        if line:
            print(line, file=sys.stderr)
        return code
    if code == 0:
        end_group()
    return code


# Frames of the doors themselves, before the user's first: left out of a traceback.
_DOORS = ("gpu_busy.outcomes", "gpu_busy.launcher", "runpy")


def _traceback_from_the_users_frame(error: BaseException) -> None:
    """The traceback Python prints for the user's own error, from their frame on."""
    doors = {"<frozen runpy>", *(m.__file__ for d in _DOORS if (m := sys.modules.get(d)))}
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in doors:
        tb = tb.tb_next
    sys.excepthook(type(error), error.with_traceback(tb), tb)
