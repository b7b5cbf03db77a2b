"""Issue 49, each defect a test: the newest good checkpoint is found by the folders, not
by the ``latest`` pointer's text, and saves are durable; a resume refuses another model;
the rendezvous is bounded; a refusal keeps its exit code under a launcher; a full disk is
one line; the library's ``check_finite`` is on by default."""

from __future__ import annotations

import errno
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.errors import NonFiniteGradientError, NonFiniteLossError
from conveyor.train import saving
from conveyor.train.checkpoints import folder, manifest
from tests.support.training import train

ROOT = Path(__file__).resolve().parents[1]


# -- the pointer is a hint; the verified folders decide --------------------------------

def tiny_checkpoints(out: Path, steps: tuple[int, ...]) -> Path:
    """Checkpoints of a small model at ``steps`` in ``out``; returns the folder."""
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in steps:
        saving.save(out, model=model, optimizer=optimizer, extra={"step": step})
    return out / "checkpoint"


@pytest.mark.parametrize("pointer, said", [
    (b"", "is empty"),
    (b"../../elsewhere", "outside the folder of checkpoints"),
    (b"/etc", "outside the folder of checkpoints"),
    (b"\xff\xfe garbage", "not a checkpoint"),
    (b"step-00000004", "older than the newest (stale)"),
    (b"step-00000008", "which is missing or incomplete"),
    (b"step-00000009", "which is missing or incomplete"),
    (None, "is missing"),
])
def test_a_damaged_pointer_is_reported_and_the_newest_verified_checkpoint_loads(
        tmp_path: Path, pointer: bytes | None, said: str) -> None:
    root = tiny_checkpoints(tmp_path, (2, 4, 6))
    (root / "step-00000008").mkdir()  # a save killed before its end: no manifest
    (root / "step-00000008" / "state.pt").write_bytes(b"partial")
    if pointer is None:
        (root / "latest").unlink()
    else:
        (root / "latest").write_bytes(pointer)
    found = folder.newest(root)
    assert found.name == "step-00000006"
    assert found.note is not None and said in found.note, found.note
    assert "the newest verified checkpoint, step-00000006, is used" in found.note
    assert saving.exists(tmp_path)
    assert saving.load(tmp_path, model=nn.Linear(3, 2))["step"] == 6
    assert saving.pointer_note(tmp_path) == found.note


def test_retention_deletes_nothing_while_the_pointer_disagrees(tmp_path: Path) -> None:
    root = tiny_checkpoints(tmp_path, (2, 4, 6))
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000004", "step-00000006"]
    tiny_checkpoints(tmp_path, ())  # nothing: the folder as it is
    (root / "latest").write_text("")
    saving._retain(root)
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000004", "step-00000006"]
    (root / "latest").write_text("step-00000006")
    saving._retain(root)  # agrees: the newest two are kept, nothing else to remove
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000004", "step-00000006"]


def test_every_file_and_the_pointer_are_flushed_with_their_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    root = tiny_checkpoints(tmp_path, (2,)).resolve()
    names = {Path(p).name for p in synced}
    assert {"state.pt", "manifest.json", ".latest.tmp"} <= names, synced
    assert str(root) in synced and str(root / "step-00000002") in synced, synced


def test_an_empty_pointer_neither_restarts_the_run_nor_deletes_its_checkpoints(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's data loss: ``latest`` empty beside intact step-4/ and step-6/ (here):
    ``--resume auto`` trained from step 0 and retention deleted both."""
    assert train(tmp_path, "--steps", "6", "--save-every", "2", "--sample-bytes", "0") == 0
    root = tmp_path / "checkpoint"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000004", "step-00000006"]
    (root / "latest").write_text("")
    capsys.readouterr()
    assert train(tmp_path, "--steps", "7", "--save-every", "2", "--sample-bytes", "0") == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert train(tmp_path, "--steps", "7", "--save-every", "2", "--sample-bytes", "0",
                 "--resume", "auto") == 0
    out = capsys.readouterr().out
    assert f"{root / 'latest'} is empty: the newest verified checkpoint, step-00000006" in out
    assert "resuming at step 6" in out
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000006", "step-00000007"]


# -- a resume goes only into the model that wrote it -----------------------------------

def test_a_resume_into_another_model_is_refused_naming_the_option(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert train(tmp_path, "--steps", "3", "--sample-bytes", "0") == 0
    options = (tmp_path / "options.json").read_text()
    capsys.readouterr()
    assert train(tmp_path, "--steps", "4", "--resume", "--heads", "4") == 2
    err = capsys.readouterr().err
    assert "was written for another model: it was written with --heads 2, this run has " \
        "--heads 4" in err and "--allow-change heads" in err, err
    assert (tmp_path / "options.json").read_text() == options
    assert train(tmp_path, "--steps", "4", "--resume", "--no-tie", "--seed", "1") == 2
    err = capsys.readouterr().err
    assert "--tie, this run has --no-tie" in err and "--seed 0, this run has --seed 1" in err
    assert train(tmp_path, "--steps", "4", "--resume", "--heads", "4", "--allow-change",
                 "heads", "--schedule", "gpipe", "--sample-bytes", "0") == 0
    out = capsys.readouterr().out
    assert "changes allowed by --allow-change: --heads 2 -> --heads 4" in out, out
    assert "with other options (the same model and data): --schedule 1f1b -> gpipe" in out


def test_a_torchrun_checkpoint_in_one_process_says_how_to_resume_it(tmp_path: Path) -> None:
    target = tmp_path / "checkpoint" / "step-00000002"
    target.mkdir(parents=True)
    for rank in (0, 1):
        (target / f"rank-{rank}.json").write_text(json.dumps({"tensors": {}, "values": {}}))
    manifest.write(target, step=2, finite=True, meta=manifest.to_json({"extra": {"step": 2}}),
                   tensors={})
    with pytest.raises(saving.CheckpointError, match=r"written under torchrun by 2 processes; "
                       r"resume it with `torchrun --nproc-per-node 2`"):
        saving.load(tmp_path, model=nn.Linear(3, 2))


# -- a full disk is one line ------------------------------------------------------------

class _FullDisk(io.RawIOBase):
    """A file that takes a few kilobytes, then fails as a full disk does."""

    def __init__(self) -> None:
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.written += len(data)
        if self.written > 2048:
            raise OSError(errno.ENOSPC, "No space left on device")
        return len(data)


def test_a_full_disk_in_torchs_zip_writer_is_one_line_and_the_last_checkpoint_is_intact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    real = open
    calls = {"state": 0}

    def fake_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path).endswith("state.pt"):
            calls["state"] += 1
            if calls["state"] > 1:  # the second save
                return _FullDisk()
        return real(path, *args, **kwargs)

    monkeypatch.setattr(saving, "open", fake_open, raising=False)
    assert train(tmp_path, "--steps", "6", "--sample-bytes", "0") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "could not save the checkpoint of step 6" in err[0], err
    assert "No space left on device; the checkpoint of step 3 is intact" in err[0], err
    assert saving.load(tmp_path, model=conveyor.train.models.transformer_lm(
        2, 16, 32, 2, max_length=16, tie=True))["step"] == 3
    assert not list((tmp_path / "checkpoint").glob(".step-*"))


# -- the library's NaN promise ---------------------------------------------------------

def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def test_pipeline_refuses_a_non_finite_loss_by_default_and_leaves_grad_alone() -> None:
    pipe = conveyor.Pipeline(_mlp(), stages=2, devices=["cpu"] * 2, chunks=2,
                             loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    x[3, 0] = float("nan")  # micro-batch 1
    with pytest.raises(NonFiniteLossError, match=r"the loss of micro-batch 1 is nan \(stage 1, "
                                                 r"step 1 of this pipeline\)"):
        pipe.step(x, y)
    assert all(p.grad is None for p in pipe.parameters())
    unchecked = conveyor.Pipeline(_mlp(), stages=2, devices=["cpu"] * 2, chunks=2,
                                  loss_fn=nn.functional.mse_loss, check_finite=False)
    assert torch.isnan(unchecked.step(x, y))


def test_pipeline_refuses_a_non_finite_gradient_of_a_finite_loss() -> None:
    class Poison(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
            return t.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * float("inf")

    class Poisoned(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return Poison.apply(t)

    model = nn.Sequential(nn.Linear(4, 8), Poisoned(), nn.Tanh(), nn.Linear(8, 2))
    pipe = conveyor.Pipeline(model, stages=2, balance=[2, 2], devices=["cpu"] * 2, chunks=2,
                             loss_fn=nn.functional.mse_loss)
    with pytest.raises(NonFiniteGradientError, match=r"the gradients of stage 0 \(0\.weight\) "
                                                     r"are not finite in step 1"):
        pipe.step(torch.randn(4, 4), torch.randn(4, 2))
    assert all(p.grad is None for p in pipe.parameters())


def test_a_gradient_that_overflows_when_divided_by_a_count_below_one_is_refused() -> None:
    """The check's flags are taken before the gradients are divided by a ``(loss_sum,
    count)`` loss's count (they ride in the loss's all-reduce); a count below 1 makes
    them larger, and they are checked again after it."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    pipe = conveyor.Pipeline(model, stages=2, balance=[2, 1], devices=["cpu"] * 2, chunks=2,
                             loss_fn=lambda out, y: ((out - y).pow(2).sum(),
                                                     torch.tensor(1e-309, dtype=torch.float64)))
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    with pytest.raises(NonFiniteGradientError, match=r"are not finite in step 1"):
        pipe.step(x, y)
    assert all(p.grad is None for p in pipe.parameters())


def test_gpipe_refuses_a_non_finite_gradient_by_default() -> None:
    pipe = conveyor.GPipe(_mlp(), balance=[2, 1], devices=["cpu"] * 2, chunks=2)
    x = torch.randn(4, 4)
    pipe(x).sum().backward()
    before = [p.grad.clone() for p in pipe.parameters()]
    out = pipe(x)
    loss = (out * torch.tensor([[1.0], [1.0], [float("nan")], [1.0]])).sum()
    with pytest.raises(NonFiniteGradientError, match=r"the gradient of the output of "
                                                     r"micro-batch 1 is not finite in call 2"):
        loss.backward()
    assert all(torch.equal(p.grad, b) for p, b in zip(pipe.parameters(), before))


# -- bounded rendezvous, exit codes under a launcher -----------------------------------

def _silent_listener() -> tuple[socket.socket, int]:
    """A port that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return server, server.getsockname()[1]


def _env(**values: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **values}


@pytest.mark.timeout(240)
def test_a_silent_store_ends_every_rank_with_one_line(tmp_path: Path) -> None:
    """Rank 1 connects to a port that accepts and never replies (waited for minutes
    before); rank 0 cannot host the store there (a raw traceback before). The library's
    own join ends within its timeout and a few seconds."""
    server, port = _silent_listener()
    joined = ("import time, conveyor\nfrom conveyor.distributed.topology import Topology\n"
              "t = time.monotonic()\ntry:\n"
              "    Topology.from_environment(data_parallel=1, stages=None, timeout=3)\n"
              "except conveyor.errors.RendezvousError as e:\n"
              "    print(f'{time.monotonic() - t:.1f}', e)\n")
    ranks = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    processes = [subprocess.Popen(
        [sys.executable, "-m", "conveyor", "train", "--timeout", "5", "--out",
         str(tmp_path / f"run{rank}")], env=_env(**ranks, RANK=str(rank)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    processes.append(subprocess.Popen([sys.executable, "-c", joined],
                                      env=_env(**ranks, RANK="1"), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        results = [p.communicate(timeout=200) for p in processes]
    finally:
        server.close()
        for p in processes:
            p.kill()
    (_, zero), (_, one), (library, _) = results
    assert processes[0].returncode == 1 and zero.strip().count("\n") == 0, zero
    assert f"could not join the process group at 127.0.0.1:{port} (env://, rank 0 of 2): " \
        "the store's port is in use by another program (EADDRINUSE)" in zero, zero
    assert processes[1].returncode == 1 and one.strip().count("\n") == 0, one
    assert f"127.0.0.1:{port} (env://, rank 1 of 2) within 15 s: the store there did not " \
        "answer" in one, one
    seconds, said = library.split(" ", 1)
    assert 3.0 <= float(seconds) < 6.0 and "within 3 s" in said, library


def test_a_refusal_before_the_process_group_keeps_its_code_and_skips_finalization(
        tmp_path: Path) -> None:
    """torchrun killed a rank refused before the group existed (-15 for the documented
    2) while the interpreter finalized torch: a launched rank now ends at once."""
    program = ("import atexit, sys\natexit.register(lambda: print('finalized', flush=True))\n"
               "from conveyor.cli.main import command\n"
               "sys.argv = ['conveyor', 'train', '--out', '/proc/sys/conveyor/run']\ncommand()\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          env=_env(TORCHELASTIC_RUN_ID="test", WORLD_SIZE="2", RANK="0",
                                   MASTER_ADDR="127.0.0.1", MASTER_PORT="1"), timeout=200)
    assert done.returncode == 2, done.stderr
    assert "conveyor train: error:" in done.stderr and "finalized" not in done.stdout
    _ = time


def test_a_failed_distributed_save_leaves_no_partial_folder_and_never_takes_a_committed_one_apart(
        tmp_path: Path) -> None:
    """A save under torchrun that failed (rank 0's disk full): rank 0 removes the folder;
    a rank whose writes went on into it after that removes its own files, and the folder
    once empty; a folder with a manifest (committed) is left alone by every rank."""
    from conveyor.train.checkpoints import dcpfiles, manifest

    target = tmp_path / "step-00000002"
    target.mkdir()
    for name in ("__1_0.distcp", "rank-1.json", "__2_0.distcp", "rank-2.json"):
        (target / name).write_bytes(b"x")
    dcpfiles._discard(target, 1)
    assert sorted(p.name for p in target.iterdir()) == ["__2_0.distcp", "rank-2.json"]
    dcpfiles._discard(target, 2)
    assert not target.exists()
    target.mkdir()
    (target / "__0_0.distcp").write_bytes(b"x")
    (target / "__1_0.distcp").write_bytes(b"x")
    dcpfiles._discard(target, 0)
    assert not target.exists()
    target.mkdir()
    for name in ("__1_0.distcp", "rank-1.json", manifest.MANIFEST):
        (target / name).write_bytes(b"x")
    for rank in (1, 0):
        dcpfiles._discard(target, rank)
    assert len(list(target.iterdir())) == 3
