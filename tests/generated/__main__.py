"""``python -m tests.generated``: run generated cases against the plain model.

    python -m tests.generated --seed 123          # its model's cases, printed in full
    python -m tests.generated --count 2500        # seeds 0..2499: 10,000 cases
    python -m tests.generated --count 500 --start 20000 --jobs 2 --json out.json
    python -m tests.generated --count 40 --compile   # each case with compile=True

Each seed draws one model and four ways to run it (cases). Each failure is shrunk to a smallest failing case and printed with the line that
reproduces it. The exit status is 1 when any case failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from tests.generated.cases import VARIANTS, Case, Result, draw_cases
from tests.generated.running import quiet, run_case, run_cases, run_seed
from tests.generated.shrink import shrink


def report(case: Case, result: Result, *, shrink_budget: int) -> dict[str, object]:
    print(f"FAIL {case}\n     {result}", flush=True)
    rerun = run_case(case)  # here: a worker's exception came back as its text only
    smallest, failure = shrink(case, rerun, budget=shrink_budget,
                               progress=lambda c: print(f"     shrunk: {c}", flush=True))
    print(f"     smallest: {smallest}\n     {failure}\n"
          f"     reproduce: python -m tests.generated --seed {case.seed}"
          f"{' --compile' if case.compiled else ''}  (case "
          f"{case.seed}.{case.variant})", flush=True)
    return {"seed": case.seed, "case": str(case), "result": str(result),
            "smallest": str(smallest), "smallest_result": str(failure)}


def _results(seeds: Sequence[int], jobs: int,
             compiled: bool) -> Iterator[tuple[Case, Result]]:
    """Each case's result, seed by seed, from ``jobs`` worker processes (or this one)."""
    if jobs <= 1:
        for seed in seeds:
            cases = draw_cases(seed, compiled=compiled)
            yield from zip(cases, run_cases(cases))
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=context) as pool:
        for results in pool.map(run_seed, seeds, [compiled] * len(seeds), chunksize=2):
            yield from results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.generated", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, help="run this seed's cases and print them")
    parser.add_argument("--start", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--count", type=int, default=100,
                        help="how many seeds (default 100), each %d cases" % VARIANTS)
    parser.add_argument("--shrink", type=int, default=200,
                        help="the most runs spent shrinking one failure (default 200)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--json", type=Path, help="write the counts and failures here")
    parser.add_argument("--compile", action="store_true",
                        help="every case with compile=True (a first compile takes seconds)")
    args = parser.parse_args(argv)
    quiet()
    torch.set_num_threads(1)
    seeds = [args.seed] if args.seed is not None else range(args.start, args.start + args.count)
    total = len(seeds) * VARIANTS
    failures = []
    start = time.monotonic()
    for done, (case, result) in enumerate(_results(seeds, args.jobs, args.compile), 1):
        if args.seed is not None:
            print(case)
        if not result.ok:
            failures.append(report(case, result, shrink_budget=args.shrink))
        elif args.seed is not None:
            print(f"  ok: {result}")
        if done % 200 == 0 or done == total:
            elapsed = time.monotonic() - start
            print(f"{done}/{total} cases ({done // VARIANTS} models), {len(failures)} "
                  f"failed, {elapsed:.0f} s", file=sys.stderr, flush=True)
    elapsed = time.monotonic() - start
    summary = {"start": seeds[0], "models": len(seeds), "cases": total,
               "failed": len(failures), "seconds": round(elapsed, 1),
               "torch": torch.__version__, "compiled": args.compile, "failures": failures}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
