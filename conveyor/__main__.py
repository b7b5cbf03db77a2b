"""``python -m conveyor``: the command line, also for ``torchrun -m conveyor train``."""

from conveyor.cli.main import command

command()
