"""``python -m gpu_busy run SCRIPT [ARGS...]``: see ``gpu_busy.launcher``."""

import sys

from gpu_busy.launcher import main

sys.exit(main())
