"""Two machines, emulated on this one: two torchrun agents (``--nnodes 2``), each one
node with one process, meet by c10d rendezvous on 127.0.0.1 and train the example with a
stage on each node; the losses equal those of the same script on threads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.launch import ROOT, run_command


def losses(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("step")]


@pytest.mark.timeout(300)
def test_two_nodes_train_with_a_stage_on_each(free_port: int) -> None:
    script = ["examples/train.py", "--steps", "3"]
    threads = run_command([sys.executable, *script])
    assert threads.returncode == 0, threads.stderr
    endpoint = f"127.0.0.1:{free_port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
         "--nproc-per-node", "1", "--node-rank", str(node), "--rdzv-backend", "c10d",
         "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes", *script],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in range(2)]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=240)[0])
    finally:
        for agent in agents:
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(outputs)
    first = next(i for i, out in enumerate(outputs) if losses(out))  # node 0 prints
    assert losses(outputs[first]) == losses(threads.stdout)
    assert len(losses(threads.stdout)) == 2
