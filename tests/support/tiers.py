"""The suite's two tiers: ``make test`` (CI, within its time budget) and ``make test-all``
(CONVEYOR_WHOLE_SUITE=1), which also runs the long tests.

A test is long when it is marked ``@pytest.mark.long`` or listed in tests/long_tests.txt,
which this module writes from a measured run of the whole suite: every test slower than
``--limit`` seconds there, except those that stand for a capability no quick test covers
(:data:`KEEP`). Each long test repeats at greater cost what a quick one checks (another
launcher, more seeds, a larger model or sample); the generators' whole samples are
``make faults``, ``make chaos``, ``make fuzz``.

    make test-all ARGS="--junitxml=times.xml"     # measure every test
    python -m tests.support.tiers times.xml --limit 1.5 > tests/long_tests.txt

or, from a run of ``make test`` alone (the quick tier, e.g. on a busy machine, with a
limit to match), adding to the list rather than writing it anew:

    make test ARGS="--junitxml=quick.xml"
    python -m tests.support.tiers quick.xml --limit 3 --add > new.txt && mv new.txt tests/long_tests.txt
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

#: Set by ``make test-all``: the long tests run too.
WHOLE_SUITE = "CONVEYOR_WHOLE_SUITE"
LISTED = Path(__file__).parents[1] / "long_tests.txt"
#: Slow tests CI keeps whatever they cost: each the one check of its capability.
KEEP = ("tests/test_tensor_parallel.py::*",  # PP x TP under torchrun: the round's principal
        "tests/test_readme_cli.py::*",  # every command of the README and the guides
        "tests/test_docs.py::test_python_blocks_run[[]README.md[]]",
        "tests/test_fsdp.py::test_sharded_schedules_equal_the_plain_model*",  # FSDP's one
        # your model and your data: a Hugging Face folder trained, resumed, exported
        "tests/test_train_user.py::test_a_hugging_face_directory_trains_*",
        "tests/test_generate.py::test_sampling_gives_model_generate_s_tokens_for_the_same_seed"
        "[[]llama[]]",  # pipelined decoding's one
        # A launch shared by the cases of a sample: their tiers are their own markers.
        "tests/test_runs.py::test_a_faulty_run_*",
        "tests/test_faults.py::test_a_generated_fault_*")


def whole_suite() -> bool:
    """Whether this run is ``make test-all``'s."""
    return os.environ.get(WHOLE_SUITE) == "1"


def listed() -> list[str]:
    """The node ids tests/long_tests.txt lists (patterns as fnmatch reads them)."""
    if not LISTED.exists():
        return []
    return [line.strip() for line in LISTED.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def is_listed(nodeid: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(nodeid, pattern) for pattern in patterns)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.tiers")
    parser.add_argument("junit", help="the JUnit XML of a run of the whole suite")
    parser.add_argument("--limit", type=float, default=1.5,
                        help="seconds above which a test is long (default 1.5)")
    parser.add_argument("--add", action="store_true",
                        help="keep the tests the list already holds (for a run of make test "
                             "alone, which does not run them)")
    args = parser.parse_args()
    rows = []
    for case in ElementTree.parse(args.junit).iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        rows.append((float(case.get("time", 0)), f"{module}::{case.get('name')}"))
    long = sorted(name.replace("[", "[[]") for seconds, name in rows
                  if seconds > args.limit and not is_listed(name, list(KEEP)))
    kept = listed() if args.add else []
    print(f"# Written by python -m tests.support.tiers {Path(args.junit).name} --limit "
          f"{args.limit:g}{' --add' if args.add else ''}: the tests over\n# {args.limit:g} s in "
          f"a measured run ({len(long)} of {len(rows)})"
          + (f", and the {len(kept)} listed before" if args.add else "")
          + ". make test-all runs them all.")
    print("\n".join(sorted(set(long) | set(kept))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
