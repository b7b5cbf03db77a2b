"""Never hang, always explain, in one process: bounded waits, the hang report, where().

A stage stuck in a layer (an endless loop) ends the call with StepTimeout within the
timeout and a grace period, naming the stuck rank and its action; its thread is left
behind and the pipeline refuses further steps. Every failed step carries the report of
where each rank stood (``error.where``). The torchrun cases are in test_hang_ranks.py.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import threading
import time

import pytest
import torch
from torch import nn

import conveyor
from conveyor.engine.watchdog.deadline import Deadlines
from conveyor.engine.watchdog.hangreport import render_report
from conveyor.schedules import Kind, build

FLOOR = 2.0  # the fitted timeout of a step after the first, at least


@pytest.fixture(autouse=True)
def short_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fitted timeouts (the default) with a floor of 2 s: the first step, slow with
    warm-up, may take 300 s; later steps 10 x the step time, at least 2 s."""
    monkeypatch.setattr(Deadlines, "floor", FLOOR)  # every pipeline's, as documented


class Gate(nn.Module):
    """Passes its input on; its ``blocked``-th forward call (not recomputations) stays
    in an endless loop until ``release`` is set, or raises / narrows the input."""

    def __init__(self, blocked: int = 0, how: str = "loop") -> None:
        super().__init__()
        self.blocked, self.how = blocked, how
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if conveyor.is_recomputing():
            return x
        self.calls += 1
        if self.calls == self.blocked:
            self.entered.set()
            if self.how == "raise":
                raise ValueError("planted failure")
            if self.how == "shape":
                return x[:, :2]
            while not self.release.is_set():  # an endless loop, until the test ends it
                sum(range(1000))
        return x


def model_with(gate: Gate) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), gate, nn.Linear(4, 4))


def pipeline(gate: Gate, schedule: str = "1f1b") -> conveyor.Pipeline:
    return conveyor.Pipeline(model_with(gate), stages=2, chunks=4, balance=[2, 2],
                             schedule=schedule, loss_fn=nn.functional.mse_loss)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 4), torch.randn(8, 4)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
def test_a_stage_stuck_in_a_layer_ends_the_step_naming_it_and_refuses_further_steps(
        schedule: str) -> None:
    gate = Gate(blocked=10)  # stage 1's second forward of step 3: 1F1
    pipe = pipeline(gate, schedule)
    try:
        pipe.step(*batch())  # steps 1 and 2: warm-up, then measured (four forwards each)
        pipe.step(*batch())
        start = time.monotonic()
        with pytest.raises(conveyor.StepTimeout) as caught:
            pipe.step(*batch())
        elapsed = time.monotonic() - start
        assert elapsed < 2 * FLOOR + 1.5, elapsed  # the timeout, the grace, a margin
        error = caught.value
        assert error.stage == 1 and error.microbatch == 1 and error.action == "1F1"
        assert str(error).startswith("rank 1 has run 1F1 (forward of micro-batch 1 on "
                                     "stage 1)"), str(error)
        where = error.where
        assert where is not None and "step 3 of" in where
        assert "rank 1  finished " in where and "in 1F1, computing for" in where
        assert "<- stuck" in where
        assert ">1F1" in where  # the clock marks it
        assert any("refuses further steps" in note for note in error.__notes__)
        with pytest.raises(conveyor.ConveyorError, match="refuses further steps"):
            pipe.step(*batch())
    finally:
        gate.release.set()


def test_gpipe_bounds_its_waits_too() -> None:
    gate = Gate(blocked=9)
    pipe = conveyor.GPipe(model_with(gate), balance=[2, 2], chunks=4)
    try:
        for _ in range(2):
            pipe(torch.randn(8, 4)).sum().backward()
        with pytest.raises(conveyor.StepTimeout, match=r"rank 1 has run 1F0") as caught:
            pipe(torch.randn(8, 4))
        assert "forward):" in (caught.value.where or "")
    finally:
        gate.release.set()


def test_a_raise_carries_the_report_of_every_rank_and_the_next_step_runs() -> None:
    gate = Gate(blocked=3, how="raise")  # stage 1, 1F2 of step 1
    pipe = pipeline(gate)
    with pytest.raises(conveyor.StageError, match="planted failure") as caught:
        pipe.step(*batch())
    where = caught.value.where or ""
    assert "rank 1  finished 1B1; failed in 1F2" in where, where
    assert "<- failed here" in where
    assert pipe.step(*batch()) > 0  # nothing is left behind: the pipeline goes on


def test_a_shape_that_changes_between_steps_names_the_stage_that_gets_it() -> None:
    gate = Gate(blocked=5, how="shape")  # stage 0's output narrows in step 2
    model = nn.Sequential(nn.Linear(4, 4), gate, nn.Linear(4, 4), nn.Linear(4, 4))
    pipe = conveyor.Pipeline(model, stages=2, chunks=4, balance=[2, 2], schedule="1f1b",
                             loss_fn=nn.functional.mse_loss)
    pipe.step(*batch())
    with pytest.raises(conveyor.StageError, match=r"stage 1, layer 2 \(Linear\) failed on "
                                                  r"micro-batch 0") as caught:
        pipe.step(*batch())
    assert "rank 1  finished nothing yet; failed in 1F0" in (caught.value.where or "")


def test_where_reads_the_ranks_of_a_running_step_without_stopping_it() -> None:
    gate = Gate(blocked=2)
    pipe = pipeline(gate)
    assert conveyor.where(pipe, file=io.StringIO()) == "no step has run yet"
    done = threading.Event()
    thread = threading.Thread(target=lambda: (pipe.step(*batch()), done.set()), daemon=True)
    thread.start()
    try:
        assert gate.entered.wait(10)
        # Rank 0 goes on until it waits for rank 1: poll for that (a busy machine may
        # take longer than any fixed pause), then read the report as it stands.
        deadline = time.monotonic() + 10
        text = conveyor.where(pipe, file=io.StringIO())
        while "waiting" not in text and time.monotonic() < deadline:
            time.sleep(0.05)
            text = conveyor.where(pipe, file=io.StringIO())
        assert "in 1F1, computing for" in text, text
        assert "rank 0  finished " in text and "waiting" in text, text
        assert not done.is_set()
    finally:
        gate.release.set()
    thread.join(10)
    assert done.is_set()  # the step went on and finished
    assert "done with its 8 actions" in conveyor.where(pipe, file=io.StringIO())


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 here")
def test_kill_usr1_prints_where_the_ranks_are() -> None:
    gate = Gate(blocked=2)
    pipe = pipeline(gate)
    printed = io.StringIO()
    previous = conveyor.report_on_signal(pipe)
    thread = threading.Thread(target=pipe.step, args=batch(), daemon=True)
    thread.start()
    try:
        assert gate.entered.wait(10)
        with contextlib.redirect_stderr(printed):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.2)  # the handler runs in this (the main) thread
        assert "in 1F1, computing for" in printed.getvalue(), printed.getvalue()
    finally:
        gate.release.set()
        signal.signal(signal.SIGUSR1, previous)
        thread.join(10)


def test_fitted_deadlines_follow_the_step_time() -> None:
    fitted = Deadlines(None)
    assert (fitted.opening, fitted.within) == (300.0, 300.0)  # the first step
    fitted.measured(50.0)  # warm-up: not a measure of later steps
    assert fitted.within == 300.0
    fitted.measured(0.05)
    assert fitted.within == FLOOR  # the floor (30 s unless a test lowers it)
    fitted.measured(12.0)
    assert fitted.within == 120.0 and fitted.opening == 300.0
    given = Deadlines(7)
    given.measured(100.0)
    assert (given.opening, given.within) == (7, 7)
    with pytest.raises(ValueError, match="positive"):
        Deadlines(0)
    own = Deadlines(None)  # one pipeline's bounds, set on it alone
    own.first, own.floor = 20.0, 0.5
    own.measured(1.0)
    own.measured(0.01)
    assert (own.opening, own.within, fitted.opening) == (20.0, 0.5, 300.0)


def test_a_pipeline_shows_its_deadlines_before_its_first_call() -> None:
    class Two(nn.Module):  # traced, so cut at the first call
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks[1](self.blocks[0](x).relu())

    pipe = conveyor.Pipeline(Two(), stages=2, chunks=2, loss_fn=nn.functional.mse_loss,
                             timeout=9)
    assert "cut at the first call" in repr(pipe) and pipe.timeouts.within == 9.0
    pipe.step(torch.randn(4, 3), torch.randn(4, 3))
    assert pipe.timeouts.within == 9.0


def test_the_report_marks_each_rank_on_the_clock() -> None:
    table = build("1f1b", 2, 2)
    snapshots = {
        0: {"rank": 0, "step": 4, "state": "waiting", "done": 2, "actions": 4,
            "last": "0F1", "action": "0B0", "seconds": 5.25, "collective": None,
            "awaited": {"kind": "gradient", "source": 1, "source_rank": 1, "stage": 0,
                        "microbatch": 0}},
        1: None,
    }
    text = render_report(table, [Kind.FORWARD, Kind.BACKWARD], snapshots,
                         {1: "did not answer: frozen"})
    assert text == (
        "where each rank stood (step 4 of '1f1b', 2 ranks, 2 micro-batches; "
        "forward+backward):\n"
        "  rank 0  finished 0F1; in 0B0, waiting 5.2 s for the gradient of micro-batch 0 "
        "from stage 1 (rank 1) (2/4 done)\n"
        "  rank 1  no answer  <- did not answer: frozen\n"
        "clock (one tick per action): UPPER done, >here, lower not reached\n"
        "        0    1    2    3    4    5\n"
        "rank 0  0F0  0F1  .    >0B0 .    0b1\n"
        "rank 1  .    1f0  1b0  1f1  1b1  .")


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 here")
def test_conveyor_train_installs_where_on_usr1_while_it_trains() -> None:
    from conveyor.train.stopping import where_on_usr1

    gate = Gate()
    pipe = pipeline(gate)
    pipe.step(*batch())
    before = signal.getsignal(signal.SIGUSR1)
    printed = io.StringIO()
    with where_on_usr1(pipe):
        with contextlib.redirect_stderr(printed):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.2)
    assert "done with its 8 actions" in printed.getvalue(), printed.getvalue()
    assert signal.getsignal(signal.SIGUSR1) is before  # put back when training ends


class Slow(nn.Module):
    """Takes ``seconds`` per forward (not per recomputation): slow, alive."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not conveyor.is_recomputing():
            time.sleep(self.seconds)
        return x


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_slow_stage_is_waited_for_as_long_as_it_makes_progress(schedule: str) -> None:
    # Under GPipe stage 0's first gradient comes after every forward of stage 1, 4 x
    # 0.5 s against a timeout of 1 s: before, stage 0 was declared stuck after 1 s.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), Slow(0.5), nn.Linear(4, 4))
    pipe = conveyor.Pipeline(model, stages=2, chunks=4, balance=[2, 2], schedule=schedule,
                             loss_fn=nn.functional.mse_loss, timeout=1, recompute="never")
    start = time.monotonic()
    pipe.step(*batch())
    assert time.monotonic() - start > 2.0  # it did wait longer than the timeout
