"""The executor's debug log: every action of the table once, with its rank, micro-batch,
messages and duration; off (and not even prepared) unless the ``conveyor`` logger is at
DEBUG; and a run logs the same numbers with it as without."""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch
from torch import nn

import conveyor
import conveyor.engine.actionlog as actionlog
from conveyor.errors import StageError
from conveyor.schedules import Schedule, gpipe

ACTION_LINE = re.compile(r"rank (\d+) (\d+[A-Z]\d+) micro-batch (\d+): (\d+\.\d{3}) ms(.*)")


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def pipeline(schedule: str = "1f1b", virtual: int = 1) -> conveyor.Pipeline:
    balance = [1, 1, 1, 2] if virtual == 2 else [2, 3]  # stage 0 ends with a 16-wide ReLU
    return conveyor.Pipeline(model(), stages=2, balance=balance, devices=["cpu", "cpu"],
                             chunks=4, schedule=schedule, virtual_stages=virtual,
                             loss_fn=nn.functional.mse_loss)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)


def logged_actions(caplog: pytest.LogCaptureFixture) -> dict[int, list[tuple[str, int]]]:
    """Per rank, in the order logged: (action, micro-batch) of each action line."""
    by_rank: dict[int, list[tuple[str, int]]] = {}
    for record in caplog.records:
        found = ACTION_LINE.fullmatch(record.getMessage())
        if found:
            rank, action, microbatch = int(found[1]), found[2], int(found[3])
            by_rank.setdefault(rank, []).append((action, microbatch))
    return by_rank


def table_actions(schedule: Schedule) -> dict[int, list[tuple[str, int]]]:
    return {rank: [(str(a), a.microbatch) for a in column]
            for rank, column in enumerate(schedule.columns)}


def action_line(caplog: pytest.LogCaptureFixture, rank: int, action: str) -> str:
    lines = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith(f"rank {rank} {action} ")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(("schedule", "virtual"), [("gpipe", 1), ("1f1b", 1),
                                                   ("zero-bubble", 1),
                                                   ("interleaved-1f1b", 2)])
def test_one_step_logs_every_action_of_the_table_once(caplog: pytest.LogCaptureFixture,
                                                      schedule: str, virtual: int) -> None:
    pipe = pipeline(schedule, virtual)
    caplog.set_level(logging.DEBUG, logger="conveyor")
    pipe.step(*batch())
    assert logged_actions(caplog) == table_actions(pipe.schedule)  # each rank in its order
    runs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run ")]
    assert len(runs) == 2
    count = sum(len(column) for column in pipe.schedule.columns)
    started = re.fullmatch(rf"run ([A-Z+]+) on ranks 0, 1: {count} actions", runs[0])
    assert started, runs[0]
    kinds = started[1]  # the kinds of the table, each named once
    assert sorted(kinds.split("+")) == sorted({a.kind.value for column in pipe.schedule.columns
                                               for a in column})
    assert re.fullmatch(rf"run {re.escape(kinds)} done in \d+\.\d{{3}} ms", runs[1])
    assert {r.name for r in caplog.records} == {"conveyor.engine.actionlog"}


def test_an_action_line_shows_what_it_received_and_sent(
        caplog: pytest.LogCaptureFixture) -> None:
    pipe = pipeline("1f1b")
    caplog.set_level(logging.DEBUG, logger="conveyor")
    pipe.step(*batch())  # 8 samples in 4 micro-batches of 2
    assert action_line(caplog, 0, "0F2").endswith(
        "ms, in [2, 6] float32, out [2, 16] float32")  # its micro-batch, the activation
    assert action_line(caplog, 1, "1F2").endswith("ms, in [2, 16] float32")  # to the loss
    assert action_line(caplog, 1, "1B2").endswith("ms, out [2, 16] float32")  # from the loss
    assert action_line(caplog, 0, "0B2").endswith("ms, in [2, 16] float32")  # kept


def test_gpipe_logs_its_forward_and_backward_runs(caplog: pytest.LogCaptureFixture) -> None:
    pipe = conveyor.GPipe(model(), [2, 3], devices=["cpu", "cpu"], chunks=4)
    caplog.set_level(logging.DEBUG, logger="conveyor")
    pipe(batch()[0]).sum().backward()
    assert logged_actions(caplog) == table_actions(gpipe(2, 4))
    runs = [r.getMessage().split(" on ")[0].split(" done")[0] for r in caplog.records
            if r.getMessage().startswith("run ")]
    assert runs == ["run F", "run F", "run B", "run B"]  # each started, then ended


def test_with_logging_off_nothing_is_logged_or_prepared(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("the action log was prepared with logging off")

    monkeypatch.setattr(actionlog, "ActionLog", refuse)
    pipe = pipeline("1f1b")
    caplog.set_level(logging.INFO, logger="conveyor")  # on, but not at DEBUG
    pipe.step(*batch())
    pipe.eval_step(batch()[0])
    assert [r for r in caplog.records if r.name.startswith("conveyor")] == []


def test_a_logged_step_computes_exactly_what_an_unlogged_one_does(
        caplog: pytest.LogCaptureFixture) -> None:
    quiet, logged = pipeline("zero-bubble"), pipeline("zero-bubble")
    expected = quiet.step(*batch())
    caplog.set_level(logging.DEBUG, logger="conveyor")
    with conveyor.record(logged) as timeline:  # the recorder and the log at once
        loss = logged.step(*batch())
    assert torch.equal(loss, expected)
    for (name, a), (_, b) in zip(quiet.named_parameters(), logged.named_parameters(),
                                 strict=True):
        assert torch.equal(a.grad, b.grad), name
    assert sorted(e.label for e in timeline.events) == sorted(
        action for actions in logged_actions(caplog).values() for action, _ in actions)


def test_a_failing_action_is_logged_and_the_error_still_raised(
        caplog: pytest.LogCaptureFixture) -> None:
    class FailsOnSecondCall(nn.Module):
        calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls == 2:
                raise ValueError("bad micro-batch")
            return x

    layers = copy.deepcopy(model())
    pipe = conveyor.Pipeline(nn.Sequential(*layers, FailsOnSecondCall()), stages=2,
                             balance=[2, 4], devices=["cpu", "cpu"], chunks=4,
                             schedule="gpipe", loss_fn=nn.functional.mse_loss)
    transport = pipe.runtime.executor.transport
    caplog.set_level(logging.DEBUG, logger="conveyor")
    with pytest.raises(StageError, match="stage 1, layer 5 .* micro-batch 1 \\(1F1\\): ValueError"):
        pipe.step(*batch())
    messages = [r.getMessage() for r in caplog.records]
    assert any(re.fullmatch(r"rank 1 1F1 micro-batch 1: failed after \d+\.\d{3} ms: "
                            r"StageError", m) for m in messages), messages
    assert any(re.fullmatch(r"run F\+B failed after \d+\.\d{3} ms: StageError", m)
               for m in messages), messages
    assert pipe.runtime.executor.transport is transport  # the log's wrapper is gone
