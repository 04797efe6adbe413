"""Lightning's own source files, recognised by where the installed package keeps them: which
errors Lightning raised, and where in it.

Example::

    if is_lightning_file(traceback_frame.f_code.co_filename):
        ...                                    # Lightning refused it, not the user's code
"""

from __future__ import annotations

import os

import lightning

ROOT = os.path.dirname(os.path.abspath(lightning.__file__)) + os.sep

# Lightning's choice of accelerator and devices (Lightning 2.0 to 2.6): what it refuses
# there is a device setting.
_DEVICE_CHOICE = tuple(
    os.path.join(ROOT, *parts)
    for parts in (
        ("pytorch", "trainer", "connectors", "accelerator_connector.py"),
        ("pytorch", "accelerators", ""),
        ("fabric", "accelerators", ""),
        ("fabric", "utilities", "device_parser.py"),
    )
)
# Lightning's restore of a checkpoint's state: _CheckpointConnector.restore* (2.0 to 2.6)
_CHECKPOINT_CONNECTOR = os.path.join(
    ROOT, "pytorch", "trainer", "connectors", "checkpoint_connector.py"
)


def is_lightning_file(filename: str) -> bool:
    """Whether ``filename`` is one of the installed Lightning's own source files."""
    return os.path.abspath(filename).startswith(ROOT)


def chooses_devices(filename: str) -> bool:
    """Whether ``filename`` is where Lightning chooses the accelerator and devices."""
    return os.path.abspath(filename).startswith(_DEVICE_CHOICE)


def restores_a_checkpoint(filename: str, function: str) -> bool:
    """Whether ``function`` of ``filename`` is Lightning's restore of a checkpoint's state."""
    return os.path.abspath(filename) == _CHECKPOINT_CONNECTOR and function.startswith("restore")
