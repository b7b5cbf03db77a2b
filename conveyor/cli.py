"""The ``conveyor`` command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from conveyor.allocator import tune_malloc

__all__ = ["main"]


def _prepare_process() -> None:
    """Settings that only work before torch starts threads (see conveyor.allocator)."""
    # Idle OpenMP threads of the main thread would otherwise spin on a core that a
    # stage thread needs; libgomp reads this when torch loads it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    tune_malloc()


def build_parser() -> argparse.ArgumentParser:
    from conveyor import demo

    parser = argparse.ArgumentParser(prog="conveyor",
                                     description="GPipe for PyTorch: pipeline training.")
    commands = parser.add_subparsers(dest="command", required=True)
    sub = commands.add_parser("demo", help="train a small model with GPipe on CPU threads "
                                           "and measure the speedup")
    demo.add_arguments(sub)
    sub.set_defaults(run=demo.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    _prepare_process()
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
