import sys

from gpu_busy.cli.run import main

sys.exit(main())
