"""The training command line: a ``LightningCLI`` that says what is wrong in one line.

``python -m template.train`` calls ``main``; a project with its own model and data calls it
the same way (``model.class_path``/``data.class_path`` name any classes). A mistake a user
can fix is one line on stderr and exit code 2, before any DDP process starts. What it adds
(``--ckpt_path last``/``best``, the precision by device): README and docs/GUIDE.md.

Example (``my_project/train.py``; ``end_process`` ends every rank by the exit rule)::

    from gpu_busy.cli import main
    from gpu_busy.process_exit import end_process
    if __name__ == "__main__":
        end_process(lambda: main(prog="python -m my_project.train"))
"""

from gpu_busy.cli.parser import TrainingCLI
from gpu_busy.cli.run import main

__all__ = ["TrainingCLI", "main"]
