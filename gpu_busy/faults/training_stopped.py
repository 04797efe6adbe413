"""The exception that ends a fit on purpose, with the line to print and the exit code.

A callback raises it at a step boundary once what must be kept is saved; the entry point
prints the message as one line (no traceback) and exits with ``exit_code``.

The line names how to resume; the door that runs the fit says how it is done there
(``set_resume_hint``: ``--ckpt_path last`` under ``make train``, ``--resume`` under the
launcher).

Example::

    raise TrainingStopped(f"SIGTERM at step 120; saved last.ckpt ({resume_hint()})", 143)
"""

_resume_hint = "trainer.fit(..., ckpt_path=<that file>)"


def set_resume_hint(how: str) -> None:
    """How this process's door resumes a run, for the stop lines."""
    global _resume_hint
    _resume_hint = how


def resume_hint() -> str:
    """``resume with <how>``, as the door that runs the fit says it."""
    return f"resume with {_resume_hint}"


class TrainingStopped(Exception):
    """Training stopped for the reason in the message.

    ``failure`` says whether it is a failure (a NaN loss, a dead rank: printed as
    ``error:``) or a stop someone asked for (a signal: printed as ``stopped:``).
    """

    def __init__(self, message: str, exit_code: int = 1, failure: bool = True) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.failure = failure
