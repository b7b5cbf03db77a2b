"""Generated cases (tests/generated) on the ranks of a process group: each rank runs the
seeds listed in ``OUT_DIR/seeds.json`` and writes, per seed, its worst error over the
loss and the gradients it holds, against the plain model it computes itself."""

from __future__ import annotations

import json
from pathlib import Path

from tests.generated.cases import draw_cases
from tests.generated.running import run_case
from tests.support.scenarios import scenario


@scenario("generated")
def generated(rank: int, world: int, out_dir: Path) -> None:
    results = {}
    for seed in json.loads((out_dir / "seeds.json").read_text()):
        # A fresh model per case: under torchrun a cut drops the other ranks' tensors.
        for case in draw_cases(seed, variants=2, ranks=world):
            result = run_case(case)
            results[f"{seed}.{case.variant}"] = {"ok": result.ok, "result": str(result),
                                                 "case": str(case)}
    (out_dir / f"generated{rank}.json").write_text(json.dumps(results))


@scenario("generated_found")
def generated_found(rank: int, world: int, out_dir: Path) -> None:
    """The cases the generator found failing only across processes (FOUND_ON_PROCESSES),
    each on its own fresh model."""
    from tests.generated.cases import FOUND_ON_PROCESSES

    results = {str(i): str(run_case(case)) for i, case in enumerate(FOUND_ON_PROCESSES)}
    (out_dir / f"found{rank}.json").write_text(json.dumps(results))
