"""The training command line: a ``LightningCLI`` that says what is wrong in one line.

``python -m template.train`` is this (the example's entry point is a few lines that call
``main``); any project with its own model and data can call it the same way. In subclass
mode the LightningModule and the DataModule are whatever ``model.class_path`` and
``data.class_path`` name; ``data.num_classes`` is passed to ``model.num_classes`` where
both exist. Also:

- ``trainer.precision: null`` (the default) resolves to bf16 mixed precision on a GPU that
  supports it and to fp32 elsewhere;
- ``--ckpt_path last`` / ``best`` find the newest good ``last.ckpt`` / the best-scoring
  checkpoint of this run, with a logger or without; every checkpoint is checked before it
  loads (``gpu_busy.resume.checkpoint_file``); validate, test and predict of a checkpoint
  write inside its run;
- a mistake a user can fix (a bad key or value, a missing file, more GPUs than exist, a
  path that is not a checkpoint) is one line on stderr and exit code 2, not a traceback,
  and it is caught before any DDP process is spawned.

Example (``my_project/train.py``)::

    import sys
    from gpu_busy.cli import main
    if __name__ == "__main__":
        sys.exit(main(prog="python -m my_project.train"))
"""

from gpu_busy.cli.parser import TrainingCLI
from gpu_busy.cli.run import main

__all__ = ["TrainingCLI", "main"]
