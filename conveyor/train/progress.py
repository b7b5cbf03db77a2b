"""How ``conveyor train`` shows its progress: a bar on a terminal, lines in a log."""

from __future__ import annotations

import sys
import time

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
