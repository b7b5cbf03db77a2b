"""Shared by the benchmarks: process set-up, timing, machine facts, result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def prepare_process() -> None:
    """What the conveyor command does before torch loads (see conveyor.allocator)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from conveyor import tune_malloc

    tune_malloc()


def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    # A copy of the tree run elsewhere (a GPU machine) may carry a stale .git: the
    # caller names the commit then.
    info["commit"] = os.environ.get("CONVEYOR_COMMIT")
    if not info["commit"]:
        try:
            info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                            capture_output=True, text=True,
                                            check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            del info["commit"]
    return info


def round_robin(configs: dict[str, Callable[[], object]], rounds: int,
                progress: bool = True, warmup: int = 1, warm_each: bool = False,
                after_round: Callable[[], object] | None = None,
                before: Mapping[str, Callable[[], object]] | None = None
                ) -> dict[str, list[float]]:
    """Times every config once per round, in turn, after ``warmup`` untimed rounds.

    Interleaving spreads the machine's slow moments over all configs, so that ratios
    measured in one run compare like with like. Returns seconds per config. With
    ``warm_each``, a config runs once untimed just before each timed run: the caches then
    hold its own model, as in a training loop that runs it step after step (after
    another config's copy of a 17 MB model, a step's first micro-batch takes 8.3 ms
    where a warm one takes 5.3); or, for a config named in ``before``, what that maps it
    to (what comes before it in its loop). ``after_round()`` runs after each timed round
    (a calibration taken in the same moments as the configs' steps).
    """
    times: dict[str, list[float]] = {name: [] for name in configs}
    before = before or {}
    for round_index in range(rounds + warmup):
        for name, step in configs.items():
            if warm_each and round_index >= warmup:
                before.get(name, step)()
            start = time.perf_counter()
            step()
            elapsed = time.perf_counter() - start
            if round_index >= warmup:
                times[name].append(elapsed)
        if after_round is not None and round_index >= warmup:
            after_round()
        if progress:
            label = "warm-up" if round_index < warmup else \
                f"round {round_index - warmup + 1}/{rounds}"
            print(f"  {label} done", file=sys.stderr, flush=True)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def lower_quartile(values: list[float]) -> float:
    """A step as measured on a shared machine: the lower quartile of its rounds. On the
    2-core VM slow moments come in bursts of rounds, each lifting every step by up to 2x
    (a replicated step of benchmarks/mesh.py: 52-62 ms, or 95-120), and lift a median
    when they fill half the rounds."""
    return statistics.quantiles(values, n=4, method="inclusive")[0]


def median_ms(times: dict[str, list[float]]) -> dict[str, float]:
    """Each configuration's median time (seconds in) in milliseconds."""
    return {name: median(values) * 1e3 for name, values in times.items()}


def write(name: str, payload: dict[str, Any], path: Path | None = None,
          measured_on: dict[str, Any] | None = None) -> Path:
    """Writes ``payload`` with the command and the machine (``measured_on``, else this
    one) to results/NAME.json (or ``path``)."""
    path = path or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    script = Path(sys.argv[0]).resolve()
    if script.is_relative_to(ROOT):
        script = script.relative_to(ROOT)
    command = " ".join(["python", str(script), *sys.argv[1:]])
    payload = {"command": command, "machine": measured_on or machine(), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


@contextmanager
def neighbour_working(rows: int, width: int) -> Iterator[None]:
    """Another thread computing (products of ``rows`` x ``width`` by ``width`` x 4
    ``width``) while the body runs, as the other stage of a two-process run will: on 2
    cores sharing caches and memory bandwidth a stage is up to ~10% slower then, and a
    profile taken alone would not see it (see docs/measured.md, "under load")."""
    import torch

    stop = threading.Event()

    def work() -> None:
        a, b = torch.randn(rows, width), torch.randn(width, 4 * width)
        while not stop.is_set():
            a @ b

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
