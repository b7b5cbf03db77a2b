"""What a run-level fault case must leave (see tests/runs): read from what its processes
wrote and what is on disk."""

from __future__ import annotations

import json
import re
import shutil
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from conveyor.train import saving
from conveyor.train.checkpoints import manifest
from tests.runs import GRACE, READ_ONLY, STEPS, TIMEOUT, Case, launch_run, logs


def problems(case: Case, out: Path, reference: Callable[[], dict[str, torch.Tensor]]
             ) -> list[str]:
    """What the case did wrong ([] when nothing); ``reference()`` gives the final
    weights of the same run without a fault."""
    if out.exists():
        shutil.rmtree(out)
    if case.fault in ("silent", "refusal"):
        return _before_the_group(case, out)
    first = launch_run(case, out, "first")
    if any(code is None for code in first.returncodes):
        return [f"still running after {first.seconds:.0f} s: a hang", logs(first)]
    fault = case.fault
    if fault in ("none", "slow"):
        return _ended_as_the_reference(out, "first", first.returncodes, reference()) \
            + ([logs(first)] if any(first.returncodes) else [])
    if fault == "options":
        return _refused_options(case, out, first.returncodes)
    if fault in ("bitflip", "truncate"):
        return _damaged_refused(case, out)
    if fault == "pointer":
        return _pointer_damaged(case, out, reference)
    if fault == "drift":
        return _another_model_refused(case, out)
    found = _stopped_in_time(case, out, first.returncodes)
    found += _newest_checkpoint_good(case, out)
    if found:
        return found + [logs(first)]
    again = launch_run(case, out, "again")
    return _ended_as_the_reference(out, "again", again.returncodes, reference()) + (
        [logs(again)] if any(again.returncodes) else [])


def _errors(out: Path, phase: str) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(out.glob(f"rank*.{phase}.err")))


def _ended_as_the_reference(out: Path, phase: str, codes: list[int | None],
                            wanted: dict[str, torch.Tensor]) -> list[str]:
    if any(codes):
        return [f"the {phase} run exited {codes}: {_errors(out, phase)[-1500:]}"]
    got = saving.load_weights(out / "run")
    differ = [name for name, tensor in wanted.items() if not torch.equal(got[name], tensor)]
    if differ:
        return [f"the final weights differ from the run without a fault: {differ[:4]}"]
    if manifest.latest(out / "run" / "checkpoint") != f"step-{STEPS:08d}":
        return [f"the newest checkpoint is {manifest.latest(out / 'run' / 'checkpoint')}"]
    return []


def _refused_options(case: Case, out: Path, codes: list[int | None]) -> list[str]:
    found = []
    if codes != [2] * len(codes) and not (case.launcher == "torchrun" and all(codes)):
        found.append(f"the ranks exited {codes}, not 2 each")
    text = _errors(out, "first")
    expected = f"the ranks were started with different options: {case.variant} is"
    if expected not in text:
        found.append(f"no rank said {expected!r}: {text[-1500:]}")
    if saving.exists(out / "run"):
        found.append("a checkpoint was written")
    return found


def _stopped_in_time(case: Case, out: Path, codes: list[int | None]) -> list[str]:
    """Every process ended non-zero; survivors named the fault, within the timeout (its
    first steps' twice) + GRACE of it."""
    if not any(codes):
        return [f"every process exited 0 after a {case.fault}"]
    fault = out / "fault.json"
    if not fault.exists():
        return ["the fault never fired"]
    fired = json.loads(fault.read_text())["time"]
    found = []
    for path in sorted(out.glob("rank*.first.json")):
        ended = json.loads(path.read_text())
        if ended["code"] == 0:
            found.append(f"{path.stem} exited 0")
        if ended["time"] - fired > 2 * TIMEOUT + GRACE:
            found.append(f"{path.stem} ended {ended['time'] - fired:.1f} s after the fault")
    text = _errors(out, "first")
    named = {"kill": f"rank {case.rank}", "freeze": f"rank {case.rank}",
             "nan": f"step {case.step}: the loss of micro-batch",
             "disk_full": "No space left on device"}[case.fault]
    if case.launcher == "one" and case.fault == "freeze":
        named = f"stage {case.rank}"
    # torchrun may end the others before one says it (it kills them at once when a rank
    # dies): its own report then names the rank that died first.
    by_torchrun = case.launcher == "torchrun" and case.fault == "kill" and re.search(
        rf"Root Cause.{{0,200}}?\brank\s*:\s*{case.rank} \(", text, re.S) is not None
    if case.launcher != "one" or case.fault != "kill":  # a lone killed process says nothing
        if named not in text and not by_torchrun:
            found.append(f"no process said {named!r}: {text[-2000:]}")
    return found


def _newest_checkpoint_good(case: Case, out: Path) -> list[str]:
    """The newest checkpoint is the one the fault allows, verified and finite."""
    root = out / "run" / "checkpoint"
    step = case.step
    newest: int | None
    if case.fault == "nan":
        newest = step - 1  # the good weights, saved on the way out
    elif case.fault == "disk_full":
        newest = step - 2 if step > 2 else None
    else:  # the saves done before the step the fault hit
        done = [s for s in range(2, step, 2)]
        newest = done[-1] if done else None
    latest = manifest.latest(root)
    partial = sorted(p.name for p in root.glob("step-*")
                     if not (p / manifest.MANIFEST).exists())
    if partial:  # a failed save leaves no partial folder (torchrun's too)
        return [f"a failed save left {', '.join(partial)} without a manifest"]
    if newest is None:
        return [] if latest is None else [f"a checkpoint {latest} where none was due"]
    if latest is None or manifest.order(latest)[0] != newest:
        return [f"the newest checkpoint is {latest}, not that of step {newest}"]
    try:
        weights = saving.load_weights(out / "run")
    except Exception as exc:  # noqa: BLE001 - the problem to report
        return [f"the newest checkpoint does not load: {exc}"]
    if not all(bool(torch.isfinite(t).all()) for t in weights.values() if t.is_floating_point()):
        return ["the newest checkpoint's weights are not finite"]
    return []


def _damaged_refused(case: Case, out: Path) -> list[str]:
    """Saved and stopped at the step; its checkpoint damaged; the resume refuses it,
    naming the file, and changes nothing; the one before is intact."""
    root = out / "run" / "checkpoint"
    latest = manifest.latest(root)
    if latest != f"step-{case.step:08d}":
        return [f"stopped at step {case.step}, the newest checkpoint is {latest}: "
                f"{_errors(out, 'first')[-1500:]}"]
    target = root / latest
    victim = max((p for p in target.iterdir() if p.name != manifest.MANIFEST),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    if case.fault == "bitflip":
        for i in range(len(data) // 2, len(data) // 2 + 64):
            data[i] ^= 0xFF
    else:
        del data[len(data) // 2:]
    victim.write_bytes(bytes(data))
    before = _files(root)
    again = launch_run(case, out, "again")
    found = []
    if not all(code == 2 for code in again.returncodes) and not (
            case.launcher == "torchrun" and all(again.returncodes)):
        found.append(f"the resume exited {again.returncodes}, not 2")
    text = _errors(out, "again")
    if f"is damaged: {victim.name} changed since it was written" not in text:
        found.append(f"the resume did not name the damaged file {victim.name}: {text[-1500:]}")
    if _files(root) != before:
        found.append("the resume changed the checkpoints")
    previous = root / f"step-{case.step - 2:08d}"
    try:
        manifest.check_files(previous, manifest.read(previous))
    except Exception as exc:  # noqa: BLE001 - the problem to report
        found.append(f"the checkpoint before is not intact: {exc}")
    return found


def _files(root: Path) -> dict[str, Any]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _stopped_at(case: Case, out: Path) -> list[str]:
    """Saved and stopped at the case's step (SIGTERM)."""
    latest = manifest.latest(out / "run" / "checkpoint")
    if latest != f"step-{case.step:08d}":
        return [f"stopped at step {case.step}, the newest checkpoint is {latest}: "
                f"{_errors(out, 'first')[-1500:]}"]
    return []


def _pointer_damaged(case: Case, out: Path,
                     reference: Callable[[], dict[str, torch.Tensor]]) -> list[str]:
    """``latest`` emptied, naming a folder outside, or an older checkpoint: the resume
    says so, loses nothing and ends as the run without a fault."""
    found = _stopped_at(case, out)
    if found:
        return found
    pointer = out / "run" / "checkpoint" / manifest.POINTER
    pointer.write_text({"empty": "", "outside": "../../elsewhere",
                        "stale": f"step-{case.step - 2:08d}"}[case.variant])
    again = launch_run(case, out, "again")
    found = _ended_as_the_reference(out, "again", again.returncodes, reference())
    said = "\n".join(again.outputs)
    if "(the pointer is only a hint)" not in said:
        found.append(f"the resume did not report the {case.variant} pointer: {said[-1500:]}")
    return found + ([logs(again)] if found else [])


def _another_model_refused(case: Case, out: Path) -> list[str]:
    """Resumed with ``--heads 4`` on a checkpoint of 2 heads (the same shapes): every rank
    refuses, naming both values; nothing changes, ``options.json`` neither."""
    found = _stopped_at(case, out)
    if found:
        return found
    before = _files(out / "run")
    again = launch_run(case, out, "again")
    if not all(code == 2 for code in again.returncodes) and not (
            case.launcher == "torchrun" and all(again.returncodes)):
        found.append(f"the resume exited {again.returncodes}, not 2")
    said = "it was written with --heads 2, this run has --heads 4"
    if said not in _errors(out, "again"):
        found.append(f"the resume did not say {said!r}: {_errors(out, 'again')[-1500:]}")
    if _files(out / "run") != before:
        found.append("the refused resume changed the run's files")
    return found


def _before_the_group(case: Case, out: Path) -> list[str]:
    """A fault before the process group: every rank ends in time, none hangs; the rank
    of a silent store names its address (1), the refused rank exits 2, not killed."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: _accept(listener, held), daemon=True).start()
    port = listener.getsockname()[1]
    try:
        first = launch_run(case, out, "first", silent_port=port)
    finally:
        listener.close()
    if any(code is None for code in first.returncodes):
        return [f"still running after {first.seconds:.0f} s: a hang", logs(first)]
    found = []
    fired = json.loads((out / "fault.json").read_text())["time"]
    ended = {int(p.name[4:p.name.index(".")]): json.loads(p.read_text())
             for p in out.glob("rank*.first.json")}
    mine = ended.get(case.rank)
    wanted = 1 if case.fault == "silent" else 2
    if mine is None or mine["code"] != wanted:
        found.append(f"rank {case.rank} ended {mine}, not with {wanted}")
    for rank, end in sorted(ended.items()):
        if end["time"] - fired > 2 * TIMEOUT + GRACE:
            found.append(f"rank {rank} ended {end['time'] - fired:.1f} s after the fault")
    # The address as the rank was given it: 127.0.0.1 by hand, torchrun's "localhost".
    host = "localhost" if case.launcher == "torchrun" else "127.0.0.1"
    said = {"silent": f"could not join the process group at {host}:{port} ",
            "refusal": f"--out {READ_ONLY} cannot be created"}[case.fault]
    if said not in _errors(out, "first"):
        found.append(f"no process said {said!r}: {_errors(out, 'first')[-1500:]}")
    codes = "\n".join(first.outputs)
    if case.launcher == "torchrun" and case.fault == "refusal" and "exitcode: 2" not in codes:
        found.append("torchrun did not see the refused rank exit 2")
    elif case.launcher != "torchrun" and first.returncodes[case.rank] != wanted:
        found.append(f"the processes exited {first.returncodes}")
    if saving.exists(out / "run"):
        found.append("a checkpoint was written")
    return found + ([logs(first)] if found else [])


def _accept(listener: socket.socket, held: list[socket.socket]) -> None:
    """Accepts every connection and never answers (a silent store)."""
    while True:
        try:
            held.append(listener.accept()[0])
        except OSError:
            return
