"""``conveyor train`` and its ``--out`` folder: refused before any work when it cannot be
used, one run at a time (a lock naming the holder's pid), one line when the disk fills
while saving, and no temporary files of a killed save left behind."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import conveyor
from conveyor.train import loop, saving
from conveyor.train.outdir import RunLock
from tests.support.launch import ROOT, run_command
from tests.support.training import TINY, checkpoint_state, one_error_line, train

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def files_in(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


# -- an --out that cannot be used: refused before any work, nothing written --------------


def test_an_out_that_names_a_file_is_refused(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "notes.txt"
    out.write_text("keep me")
    assert train(out, "--steps", "1") == 2
    assert f"--out {out} is a file, not a folder; choose another --out" in one_error_line(
        capsys)
    assert files_in(tmp_path) == {"notes.txt": b"keep me"}


def test_an_out_inside_a_file_is_refused(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    out = tmp_path / "notes.txt" / "run"
    assert train(out, "--steps", "1") == 2
    assert (f"--out {out} cannot be created: {tmp_path / 'notes.txt'} is a file"
            in one_error_line(capsys))
    assert files_in(tmp_path) == {"notes.txt": b"keep me"}


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
@pytest.mark.parametrize("inside", [True, False])
def test_an_out_that_cannot_be_written_is_refused(tmp_path: Path, inside: bool,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    out = locked / "run" if inside else locked
    locked.chmod(0o500)
    try:
        assert train(out, "--steps", "1") == 2
        line = one_error_line(capsys)
    finally:
        locked.chmod(0o700)
    verb = "created" if inside else "written"
    assert f"--out {out} cannot be {verb}: {locked} is not writable" in line
    assert list(locked.iterdir()) == []


# -- one run at a time ------------------------------------------------------------------


def hold_lock(out: Path) -> subprocess.Popen[str]:
    """Another process that holds ``out``'s lock until its stdin closes or it is killed."""
    code = ("import sys; from pathlib import Path; from conveyor.train.outdir import RunLock\n"
            "with RunLock(Path(sys.argv[1])):\n"
            "    print('held', flush=True)\n"
            "    sys.stdin.read()\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdout is not None
    if holder.stdout.readline() != "held\n":
        holder.kill()
        raise AssertionError(f"the holder did not take the lock: {holder.communicate()}")
    return holder


@pytest.mark.timeout(60)
def test_a_second_run_on_the_same_out_is_refused_naming_the_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    holder = hold_lock(tmp_path)
    try:
        live = tmp_path / ".checkpoint-live.tmp"  # the first run's save in progress
        live.write_bytes(b"half")
        before = files_in(tmp_path)
        assert train(tmp_path, "--steps", "1") == 2
        line = one_error_line(capsys)
        assert (f"{tmp_path} is in use by another conveyor train (pid {holder.pid}); wait "
                "for it to end, or choose another --out") in line
        assert files_in(tmp_path) == before  # its temporary file too
    finally:
        holder.kill()  # as a crash would: the system drops the lock with the process
        holder.communicate()
    assert (tmp_path / ".lock").exists()  # left by the kill, but nobody holds it
    live.unlink()
    assert train(tmp_path, "--steps", "1", "--sample-bytes", "0") == 0
    assert checkpoint_state(tmp_path)["extra"]["step"] == 1


def test_the_lock_is_released_and_removed_when_a_run_ends(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert train(tmp_path / "run", "--steps", "1", "--sample-bytes", "0") == 0
    assert not (tmp_path / "run" / ".lock").exists()
    with RunLock(tmp_path / "run"):  # free again
        assert int((tmp_path / "run" / ".lock").read_text().split()[0]) == os.getpid()
    capsys.readouterr()
    assert train(tmp_path / "run", "--steps", "1") == 2  # an error after the lock was taken
    assert "already holds a checkpoint" in one_error_line(capsys)
    assert not (tmp_path / "run" / ".lock").exists()


def test_a_lock_refuses_a_second_holder_and_removes_the_folders_it_made(
        tmp_path: Path) -> None:
    out = tmp_path / "a" / "b"
    with RunLock(out):
        with pytest.raises(conveyor.ConfigError, match=rf"pid {os.getpid()}\)"):
            RunLock(out).acquire()
    assert not (tmp_path / "a").exists()  # made for the lock, empty, removed with it


# -- a full disk while saving -----------------------------------------------------------


@pytest.mark.parametrize("fails, message", [
    ("checkpoint", "could not save the checkpoint of step 6 to {out}: No space left on "
                   "device; the checkpoint of step 3 is intact"),
    ("summary", "could not save the summary to {out}: No space left on device; the "
                "checkpoint of step 6 is intact"),
])
def test_a_full_disk_while_saving_is_one_line_and_the_last_checkpoint_stays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        fails: str, message: str) -> None:
    real_save = torch.save
    saves = 0

    def fill_the_disk_at_step_6(obj: Any, file: Any, *args: Any, **kwargs: Any) -> None:
        nonlocal saves
        saves += 1
        if saves == 2:
            file.write(b"PK\x03\x04 half a zip archive")
            raise OSError(ENOSPC.errno, ENOSPC.strerror)
        real_save(obj, file, *args, **kwargs)

    def fill_the_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError(ENOSPC.errno, ENOSPC.strerror)

    if fails == "checkpoint":
        monkeypatch.setattr(torch, "save", fill_the_disk_at_step_6)
    else:
        monkeypatch.setattr(loop, "write_report", fill_the_disk)
    assert train(tmp_path, "--steps", "6", "--sample-bytes", "0") == 1
    monkeypatch.undo()
    assert one_error_line(capsys) == "conveyor train: error: " + message.format(out=tmp_path)

    saved = 3 if fails == "checkpoint" else 6
    assert checkpoint_state(tmp_path)["extra"]["step"] == saved  # loads, and is that step
    assert not [p.name for p in tmp_path.iterdir()
                if p.name.startswith(".checkpoint") or p.name in ("summary.json", ".lock")]


# -- temporary files of a killed save ---------------------------------------------------


def test_temporary_files_of_a_killed_save_are_removed_at_the_next_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert train(tmp_path, "--steps", "3", "--sample-bytes", "0") == 0
    root = tmp_path / "checkpoint"
    stale = [root / ".step-k1ll3d.tmp", root / ".step-a9b8c7.tmp", root / "step-00000009"]
    for path in stale:  # two half-written, one whose manifest was never written
        path.mkdir()
        (path / "state.pt").write_bytes(b"PK\x03\x04 half a zip archive")
    other = root / "notes.step-x.tmp"  # not a name saving.save makes
    other.write_text("keep me")
    capsys.readouterr()

    assert train(tmp_path, "--steps", "4", "--resume") == 0
    out = capsys.readouterr().out
    assert out.count("removed 3 temporary files of an interrupted save") == 1
    assert ".step-a9b8c7.tmp, .step-k1ll3d.tmp, step-00000009" in out
    assert not any(path.exists() for path in stale)
    assert other.read_text() == "keep me"
    assert checkpoint_state(tmp_path)["extra"]["step"] == 4
    assert saving.remove_temporaries(tmp_path) == []


@pytest.mark.timeout(300)
def test_under_torchrun_every_rank_stops_when_rank_0_is_refused(tmp_path: Path) -> None:
    with RunLock(tmp_path):
        before = files_in(tmp_path)
        result = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc-per-node", "2", "-m", "conveyor", "train", *TINY,
                              "--steps", "1", "--out", str(tmp_path)])
        assert files_in(tmp_path) == before
    assert result.returncode != 0, result.stdout + result.stderr
    ours = [line for line in result.stderr.splitlines() if line.startswith("conveyor train")]
    assert ours == [f"conveyor train: error: {tmp_path} is in use by another conveyor train "
                    f"(pid {os.getpid()}); wait for it to end, or choose another --out"]
    # Rank 1 does not write, but learns of the refusal and stops with the same code
    # (torchrun's report). Whichever rank ends first, torchrun stops the other: on a busy
    # machine rank 0's exit may come first, and rank 1 is then ended by torchrun.
    assert re.search(r"rank +: 1 \(local_rank: 1\)\n +exitcode +: 2 ", result.stderr) or \
        re.search(r"rank +: 0 \(local_rank: 0\)\n +exitcode +: 2 ", result.stderr), \
        result.stderr
    assert "training T(" not in result.stdout
