"""``python -m tests.runs``: run-level fault cases of ``conveyor train`` (tests/runs).

    python -m tests.runs --seed 3            # one drawn case
    python -m tests.runs --all               # every case, with the count and time
    python -m tests.runs --all --json out.json
    python -m tests.runs --all --fault pointer,drift   # every case of these faults
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from tests.runs import FAULTS, check, every_case, pick


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.runs")
    parser.add_argument("--seed", type=int, help="run the case drawn from this seed")
    parser.add_argument("--all", action="store_true", help="run every case")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--fault", default="", metavar="NAME,...",
                        help=f"only the cases of these faults (of {', '.join(FAULTS)})")
    args = parser.parse_args()
    cases = every_case() if args.all else [pick(args.seed or 0)]
    chosen = {name for name in args.fault.split(",") if name}
    if chosen - set(FAULTS):
        parser.error(f"--fault: unknown {', '.join(sorted(chosen - set(FAULTS)))}")
    cases = [case for case in cases if not chosen or case.fault in chosen]
    start, failed, results = time.monotonic(), 0, []
    with tempfile.TemporaryDirectory() as scratch:
        for index, case in enumerate(cases, 1):
            found, seconds = check(case, Path(scratch) / f"case{index}")
            failed += bool(found)
            results.append({"case": str(case), "ok": not found, "seconds": round(seconds, 1),
                            "problems": found})
            print(f"[{index}/{len(cases)}] {'ok  ' if not found else 'FAIL'} {case} "
                  f"({seconds:.0f} s)", flush=True)
            for problem in found:
                print("    " + problem.replace("\n", "\n    "), flush=True)
    total = time.monotonic() - start
    print(f"{len(cases)} cases, {failed} failed, {total:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"cases": len(cases), "failed": failed,
                                               "seconds": round(total), "results": results},
                                              indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
