"""The one exception type for mistakes a user can fix.

The entry point prints a ``UserError`` as a single line (no traceback) and exits non-zero;
everything else is a bug and keeps its traceback.

Example::

    raise UserError("configs/nope.yaml does not exist; pick one from configs/")
"""


class UserError(Exception):
    """A mistake in the user's input (config, paths, devices) with a message that says the fix."""


class TrainingStopped(Exception):
    """Training stopped on purpose, for the reason in the message (a non-finite loss, say).

    The entry point prints it as one line and exits with ``exit_code`` (1 unless the stop
    says otherwise: 143 after SIGTERM); what was saved before it is kept.
    """

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
