"""The one exception type for mistakes a user can fix.

The entry point prints a ``UserError`` as a single line (no traceback) and exits non-zero;
everything else is a bug and keeps its traceback.

Example::

    raise UserError("configs/nope.yaml does not exist; pick one from configs/")
"""


class UserError(Exception):
    """A mistake in the user's input (config, paths, devices) with a message that says the fix."""
