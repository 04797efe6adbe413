"""``python -m gpu_busy run SCRIPT [ARGS...]``: see ``gpu_busy.launcher``."""

from gpu_busy.launcher import command

command()
