"""Ranks on one GPU share one thread (``conveyor.engine.executor.device_lanes``).

The lane interleaves their columns by the table's clock. Without a GPU the same lanes
are made of CPU ranks (the device types that share a thread, patched): generated
models under every schedule must stay exact, on one thread.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import conveyor
from conveyor.engine import executor
from conveyor.schedules import Kind, build
from conveyor.schedules.table import dependencies
from tests.generated.cases import TOLERANCE, draw_cases
from tests.generated.running import quiet, run_cases


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble",
                                  "zb-v", "dualpipe-v"])
def test_a_lane_runs_every_action_after_those_it_needs_and_each_column_in_order(
        name: str) -> None:
    table = build(name, 3, 6, virtual_stages=2 if name == "interleaved-1f1b" else 1)
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    columns = dict(enumerate(table.columns))
    lanes = executor.device_lanes(columns, {0: gpu, 1: gpu, 2: cpu}, table)
    assert sorted(lanes) == [0, 2] and {r for r, _ in lanes[0]} == {0, 1}
    assert [a for _, a in lanes[2]] == list(table.columns[2])
    done: set[object] = set()
    for rank, action in lanes[0]:
        assert all(d in done or table.stage_ranks[d.stage] == 2
                   for d in dependencies(action, table)), action
        done.add(action)
    for rank in (0, 1):
        assert [a for r, a in lanes[0] if r == rank] == list(table.columns[rank])


def test_a_phase_of_the_table_keeps_its_own_order() -> None:
    """GPipe's face runs the forwards, then later the backwards: each alone."""
    table = build("1f1b", 2, 4)
    forwards = {r: [a for a in c if a.kind is Kind.FORWARD] for r, c in enumerate(table.columns)}
    gpu = torch.device("cuda", 0)
    lane = executor.device_lanes(forwards, {0: gpu, 1: gpu}, table)[0]
    assert [str(a) for _, a in lane] == ["0F0", "0F1", "1F0", "0F2", "1F1", "0F3", "1F2",
                                         "1F3"]


@pytest.mark.parametrize("seed", range(6))
def test_generated_models_are_exact_with_every_rank_on_one_thread(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    quiet()
    monkeypatch.setattr(executor, "SHARE_A_THREAD", frozenset({"cpu", "cuda"}))
    cases = draw_cases(seed)
    for case, result in zip(cases, run_cases(cases)):
        assert result.error <= TOLERANCE, (case, result)


def test_stages_on_one_device_run_on_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(executor, "SHARE_A_THREAD", frozenset({"cpu"}))
    threads = set()
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    for layer in model:
        layer.register_forward_hook(lambda *_: threads.add(threading.current_thread().name))
    pipe = conveyor.Pipeline(model, loss_fn=nn.functional.mse_loss, chunks=4,
                             schedule="1f1b", balance=[1, 1, 1, 1], devices=["cpu"] * 4)
    pipe.step(torch.randn(8, 4), torch.randn(8, 4))
    assert threads == {threading.current_thread().name}
