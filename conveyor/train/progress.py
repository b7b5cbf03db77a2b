"""How ``conveyor train`` shows its progress: a bar on a terminal, lines in a log, and
with ``--verbose`` every action of the pipeline."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator

__all__: list[str] = []


class Progress:
    """A tqdm bar on a terminal when tqdm is installed, else a line every 10 seconds;
    silent off rank 0."""

    def __init__(self, total: int, start: int, show: bool) -> None:
        self.show, self.bar, self.last = show, None, 0.0
        if show and sys.stdout.isatty():  # in a log, lines now and then read better
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True,
                                file=sys.stdout)
            except ImportError:
                pass

    def update(self, step: int, figures: dict[str, str]) -> None:
        """Counts ``step`` as done and shows ``figures`` (name: value) beside it."""
        if not self.show:
            return
        if self.bar is not None:
            self.bar.set_postfix(figures, refresh=False)
            self.bar.update(1)
        elif time.monotonic() - self.last > 10:
            self.last = time.monotonic()
            print(f"step {step}  " + "  ".join(f"{k} {v}" for k, v in figures.items()),
                  flush=True)

    def write(self, text: str) -> None:
        """Prints a line (above the bar, where there is one)."""
        if self.show:
            if self.bar is not None:
                self.bar.write(text)
            else:
                print(text, flush=True)

    def close(self) -> None:
        """Ends the bar, if there is one."""
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def verbose(enabled: bool) -> Iterator[None]:
    """With ``--verbose``: the ``conveyor`` logger at DEBUG, printing to stderr, while the
    command runs (``logging.basicConfig`` for that logger alone). Under torchrun each
    line starts with the process's rank; the messages name the pipeline rank."""
    if not enabled:
        yield
        return
    logger = logging.getLogger("conveyor")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    process = f"process {os.environ.get('RANK', '0')} " if world > 1 else ""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s.%(msecs)03d {process}%(name)s: %(message)s", datefmt="%H:%M:%S"))
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
