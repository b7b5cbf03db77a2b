"""``python -m tests.zoo [--family NAME ...] [--json PATH]``: every family of the zoo
pipelined on two threads, cut by ``stages=2`` and at its named split, under 1F1B and
under zero-bubble with recomputation, each against the plain model; prints the family x
result table (the README's) and writes it as JSON."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

from tests.zoo import families
from tests.zoo.families import BATCH, CHUNKS, FAMILIES
from tests.zoo.harness import (AUTO, BF16_TOLERANCE, SCHEDULES, Outcome, bf16_run,
                               pipelined, prepare, tolerance)
from tests.zoo.reasons import reason_of


def run_family(name: str) -> dict[str, object]:
    """One family: its reference once, then each split under each schedule."""
    family = FAMILIES[name]
    start = time.perf_counter()
    row: dict[str, object] = {"family": name, "kind": family.kind,
                              "dtype": str(family.dtype).removeprefix("torch."),
                              "tolerance": tolerance(family.dtype), "runs": []}
    try:
        prepared = prepare(family)
    except Exception as error:  # noqa: BLE001 - a family that does not build is a result
        row["build_failure"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        row["result"] = f"does not build: {row['build_failure']}"
        return row
    row["named_split"] = prepared.split_at
    outcomes = [pipelined(prepared, split, schedule)
                for split in (AUTO, "named") for schedule in SCHEDULES]
    row["runs"] = [vars(outcome) | {"exact": outcome.exact(family.dtype),
                                    "reason": reason_of(name, outcome)}
                   for outcome in outcomes]
    row["auto_split"] = outcomes[0].cut or outcomes[1].cut
    row["result"] = summary(name, family.dtype, outcomes)
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def summary(name: str, dtype: torch.dtype, outcomes: list[Outcome]) -> str:
    """``exact (max error 3e-16)`` when every run is; else each distinct failure once, with
    the runs it hit and its reason."""
    family = FAMILIES[name]
    exact = [o for o in outcomes if o.exact(dtype)]
    if len(exact) == len(outcomes):
        worst = max(o.error or 0.0 for o in outcomes)
        precision = "" if dtype == torch.float64 else f" in {str(dtype)[6:]}, at 1e-5"
        loose = max(o.float32_error or 0.0 for o in outcomes)
        if family.float32_grads:
            precision += f"; /{family.float32_grads}/ {loose:.0e}, at 1e-5"
        why = f": {family.why}" if family.why else ""
        return f"exact (max error {worst:.0e}{precision}){why}"
    parts: dict[str, list[str]] = {}
    for o in outcomes:
        if o.exact(dtype):
            what = f"exact ({o.error:.0e})"
        elif o.failure is None:
            what = f"NOT EXACT: relative error {o.error:.1e} -- {family.why or 'unexplained'}"
        else:
            what = f"{o.failure[:160]} -- {reason_of(name, o)}"
        parts.setdefault(what, []).append(f"{o.split} {o.schedule}")
    return "; ".join(f"{', '.join(runs)}: {what}" for what, runs in parts.items())


def table(rows: list[dict[str, object]]) -> str:
    lines = ["| family | kind | auto split (`stages=2`) | named split | result |",
             "| --- | --- | --- | --- | --- |"]
    for row in rows:
        auto = ", ".join(f"`{c}`" for c in row.get("auto_split") or []) or "-"
        named = ", ".join(f"`{c}`" for c in row.get("named_split") or []) or "-"
        result = str(row["result"]).replace("|", "\\|")
        lines.append(f"| {row['family']} | {row['kind']} | {auto} | {named} | {result} |")
    return "\n".join(lines)


def transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.zoo", description=__doc__)
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES),
                        help="run only this family (repeatable); default: all")
    parser.add_argument("--precision", choices=["bf16"],
                        help="instead: each family in float32 at its named split with "
                             "precision='bf16', against the plain model under bfloat16 "
                             "autocast (1F1B and zero-bubble)")
    parser.add_argument("--json", type=Path,
                        help="write the rows as JSON here; with --family, replace those "
                             "families' rows in the file and keep the others")
    parser.add_argument("--length", type=int, default=families.LENGTH,
                        help="tokens per sample (default 8; 9, 11 or 12 make a token "
                             "count that is no power of two)")
    args = parser.parse_args(argv)
    families.LENGTH = args.length
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if args.precision:
        return run_bf16(args.family or list(FAMILIES), args.json)
    start = time.perf_counter()
    rows = []
    for name in args.family or list(FAMILIES):
        rows.append(run_family(name))
        print(f"{name}: {rows[-1]['result']} ({rows[-1].get('seconds', '-')} s)",
              file=sys.stderr, flush=True)
    seconds = time.perf_counter() - start
    record = {"command": "python -m tests.zoo " + " ".join(argv or sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "seconds": round(seconds),
              "machine": f"{platform.machine()}, {platform.system()}, {os.cpu_count()} cores",
              "torch": torch.__version__, "transformers": transformers_version(),
              "batch": BATCH, "length": families.LENGTH, "chunks": CHUNKS, "stages": 2, "schedules": SCHEDULES,
              "families": rows}
    if args.json and args.family and args.json.exists():
        record = merged(json.loads(args.json.read_text()), record)
    rows = record["families"]  # type: ignore[assignment]
    print(table(rows))
    exact = sum(bool(row["runs"]) and all(run["exact"] for run in row["runs"])  # type: ignore
                for row in rows)
    print(f"\n{exact} of {len(rows)} families exact in every run; {seconds:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return 0


def run_bf16(names: list[str], path: Path | None) -> int:
    """Every family under ``precision="bf16"`` (see ``harness.bf16_run``)."""
    start, rows = time.perf_counter(), []
    for name in names:
        outcomes = [bf16_run(FAMILIES[name], schedule) for schedule in SCHEDULES]
        ok = all(o.failure is None and (o.error or 0.0) <= BF16_TOLERANCE for o in outcomes)
        what = "; ".join(f"{o.schedule}: {o.failure or f'{o.error:.1e}'}" for o in outcomes)
        rows.append({"family": name, "ok": ok, "runs": [vars(o) for o in outcomes]})
        print(f"{name}: {'ok' if ok else 'FAILED'} ({what})", flush=True)
    seconds = time.perf_counter() - start
    passed = sum(row["ok"] for row in rows)
    print(f"\n{passed} of {len(rows)} families train under precision='bf16' within "
          f"{BF16_TOLERANCE:g} of the plain model under bfloat16 autocast; {seconds:.0f} s")
    if path:
        path.write_text(json.dumps({"command": "python -m tests.zoo --precision bf16",
                                    "date": time.strftime("%Y-%m-%d"),
                                    "seconds": round(seconds), "torch": torch.__version__,
                                    "families": rows}, indent=1, default=str) + "\n")
    return 0 if passed == len(rows) else 1


def merged(whole: dict[str, object], part: dict[str, object]) -> dict[str, object]:
    """The whole zoo's record with the rows of ``part`` in place of its own, and the
    command and date of that part noted as an update."""
    fresh = {row["family"]: row for row in part["families"]}  # type: ignore[attr-defined]
    rows = [fresh.pop(row["family"], row)
            for row in whole["families"]]  # type: ignore[attr-defined]
    updates = list(whole.get("updates", []))  # type: ignore[call-overload]
    updates.append({k: part[k] for k in ("command", "date", "seconds")})
    return whole | {"families": rows + list(fresh.values()), "updates": updates}


if __name__ == "__main__":
    sys.exit(main())
