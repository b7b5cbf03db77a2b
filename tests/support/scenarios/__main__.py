"""One process of a multi-process test: ``python -m tests.support.scenarios NAME OUT_DIR``.

Started by ``tests.support.launch.launch`` with RANK and WORLD_SIZE set: joins a gloo
process group through the file CONVEYOR_INIT_FILE names (no fixed port), or else by
env:// (MASTER_ADDR and MASTER_PORT, by hand or from torchrun), runs the scenario
registered as NAME with ``(rank, world, out_dir)``, destroys the group and ends as a
script does (``SCENARIO_PINNED=1``: each rank pinned to a core first).
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.support.scenarios import (
    SCENARIOS,
    fsdp,
    generated,
    hang,
    modeldir,
    pipeline,
    rebalance,
    replicated,
    tensor,
)

#: Importing these modules registers their scenarios in SCENARIOS.
MODULES = (pipeline, fsdp, hang, rebalance, generated, replicated, modeldir, tensor)


def main() -> None:
    name, out_dir = sys.argv[1], Path(sys.argv[2])
    if name not in SCENARIOS:
        raise SystemExit(f"no scenario {name!r} in {', '.join(m.__name__ for m in MODULES)}; "
                         f"registered: {', '.join(sorted(SCENARIOS))}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    if os.environ.get("SCENARIO_PINNED"):  # as a launcher's CPU binding: a core per rank (and
        # the threads gloo starts)
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    init_file = os.environ.get("CONVEYOR_INIT_FILE")
    dist.init_process_group("gloo", init_method=f"file://{init_file}" if init_file else "env://",
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    SCENARIOS[name](rank, world, out_dir)
    dist.destroy_process_group()
    # Then the interpreter's own finalization, as a user's script ends: gloo's threads
    # that free what a pipeline ran late must not abort a rank that ended well
    # (conveyor.distributed.watch lets them finish first).


if __name__ == "__main__":
    main()
