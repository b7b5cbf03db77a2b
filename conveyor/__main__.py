"""``python -m conveyor``: the command line, also for ``torchrun -m conveyor train``."""

import sys

from conveyor.cli import main

sys.exit(main())
