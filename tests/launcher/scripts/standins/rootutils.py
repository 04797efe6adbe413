"""A stand-in for ``rootutils`` with the one call lightning-hydra-template's ``src/train.py``
makes. The package itself installs a top-level ``tests`` package into site-packages (1.0.5 to
1.0.7), which would shadow this project's ``tests``; this does what its ``setup_root`` does
for the template: the folder holding the indicator file, on ``sys.path`` and as
``PROJECT_ROOT`` (``configs/paths/default.yaml`` reads it).
"""

import os
import sys
from pathlib import Path


def setup_root(search_from: str, indicator: str = ".project-root", pythonpath: bool = True,
               **_: object) -> Path:  # fmt: skip
    start = Path(search_from).resolve()
    root = next(p for p in [start, *start.parents] if (p / indicator).exists())
    if pythonpath:
        sys.path.insert(0, str(root))
    os.environ["PROJECT_ROOT"] = str(root)
    return root
