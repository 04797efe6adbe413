"""Entry point: ``python -m template.train fit --config configs/default.yaml [--key=value ...]``.

The command line itself is the package's (``gpu_busy.cli``): Lightning's CLI with the
checks that turn a mistake into one line. This file only checks the config files first,
with nothing heavier than a YAML parser, so that a broken one is said at once rather than
after the ten seconds torch and Lightning take to import.
"""

import sys

from gpu_busy.config_files import check_config_files
from gpu_busy.errors import UserError

if __name__ == "__main__":
    try:
        check_config_files(sys.argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

    from gpu_busy.cli import main
    from gpu_busy.process_exit import end_process

    end_process(lambda: main(prog="python -m template.train"))
