"""The exception that ends a fit on purpose, with the line to print and the exit code.

A callback raises it at a step boundary once what must be kept is saved; the entry point
prints the message as one line (no traceback) and exits with ``exit_code``.

Example::

    raise TrainingStopped("stopped by SIGTERM at step 120; saved last.ckpt", exit_code=143)
"""


class TrainingStopped(Exception):
    """Training stopped for the reason in the message.

    ``failure`` says whether it is a failure (a NaN loss, a dead rank: printed as
    ``error:``) or a stop someone asked for (a signal: printed as ``stopped:``).
    """

    def __init__(self, message: str, exit_code: int = 1, failure: bool = True) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.failure = failure
