"""``python -m tests.faults``: run generated fault cases and say which went wrong.

    python -m tests.faults --seed 7        the case of seed 7, and each rank's error
    python -m tests.faults --case env2 freeze backward later 0     a case by name
    python -m tests.faults --list          every case, numbered
    python -m tests.faults --numbers 3,17  the cases of these numbers (a run's failures)
    python -m tests.faults --all           every case (make faults; --jobs N: N at once)
    python -m tests.faults --sample 8      the CI sample (tests/test_faults.py)

Each case's processes write under ``--out`` (a temporary folder by default); the exit
status is 1 if any case went wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from tests.faults import Case, check, every_case, pick, sample


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults")
    chosen = parser.add_mutually_exclusive_group(required=True)
    chosen.add_argument("--seed", type=int, help="run the case this seed picks")
    chosen.add_argument("--case", nargs="+", metavar="FIELD",
                        help="run one case: LAUNCHER FAULT WHERE PHASE RANK [APP]")
    chosen.add_argument("--all", action="store_true", help="run every case")
    chosen.add_argument("--sample", type=int, metavar="N", help="run the CI sample of N")
    chosen.add_argument("--numbers", type=lambda text: [int(n) for n in text.split(",")],
                        help="run the cases of these numbers (--list), e.g. a run's failures")
    chosen.add_argument("--list", action="store_true", help="list every case")
    parser.add_argument("--out", type=Path, help="where the cases' processes write")
    parser.add_argument("--jobs", type=int, default=1,
                        help="cases run at once (most of a case is waiting for a timeout)")
    args = parser.parse_args(argv)
    everything = cases = every_case()
    if args.list:
        for number, case in enumerate(cases):
            print(f"{number:4d}  {case}")
        print(f"{len(cases)} cases")
        return 0
    if args.seed is not None:
        cases = [pick(args.seed)]
    elif args.case is not None:
        fields = args.case
        cases = [Case(*fields[:4], int(fields[4]), *fields[5:])]
    elif args.sample is not None:
        cases = sample(args.sample)
    elif args.numbers is not None:
        cases = [cases[n] for n in args.numbers]
    out = args.out or Path(tempfile.mkdtemp(prefix="conveyor-faults-"))
    start, failed, barriers = time.monotonic(), 0, 0
    numbers = [everything.index(case) if case in everything else -1 for case in cases]
    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        running = {pool.submit(check, case, out / f"case{number}"): (number, case)
                   for number, case in zip(numbers, cases)}
        for done in as_completed(running):
            (found, seconds), (number, case) = done.result(), running[done]
            failed += bool(found)
            print(f"{'FAIL' if found else 'ok  '} {seconds:5.1f} s  {number:4d} {case}",
                  flush=True)
            for problem in found:
                print("    " + problem.replace("\n", "\n    "))
            barrier = out / f"case{number}" / "exit-barrier"
            if barrier.exists():  # see tests.faults._end_exit_barrier
                barriers += 1
                print("    torchrun's exit barrier, ended after the workers: "
                      + barrier.read_text(), end="")
            if len(cases) == 1:
                _show(out / f"case{number}")
    print(f"{len(cases)} cases, {failed} failed, {time.monotonic() - start:.0f} s "
          f"(output in {out})" + (f"; {barriers} ended a torchrun agent waiting in its exit "
                                  "barrier for a failed one" if barriers else ""))
    return 1 if failed else 0


def _show(out: Path) -> None:
    """Each rank's error, with its report, as its process ended."""
    for path in sorted(out.glob("rank*.json")):
        error = json.loads(path.read_text()).get("error")
        if error is not None:
            print(f"\n{path.stem}: {error['type']}: {error['text']}")
            if error.get("where"):
                print(error["where"])


if __name__ == "__main__":
    sys.exit(main())
