"""The ``conveyor`` command: its parser and the bodies of its sub-commands."""

from conveyor.cli.main import main

__all__ = ["main"]
