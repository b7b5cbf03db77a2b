"""The folder of checkpoints: which one is the newest good one, found by verifying the
step folders themselves; the ``latest`` pointer is only a hint.

A checkpoint's folder is complete once its manifest is written (the last file of a
save, and it lists every other file). The pointer is written after it, so a power loss,
a crash between the two, or a hand that edited it can leave the pointer empty, damaged,
naming an older checkpoint (stale) or a folder outside ``checkpoint/``: none of these
loses a checkpoint. The newest step folder whose manifest reads and verifies, with
every file it lists present, resumes; a pointer that disagrees is reported in one line,
and while it disagrees retention deletes nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from conveyor.train.checkpoints import durable, manifest
from conveyor.train.errors import CheckpointError

__all__: list[str] = []

_NAME = re.compile(r"step-\d{8}(\.\d+)?")


@dataclass(frozen=True)
class Newest:
    """The newest verified checkpoint in a folder, and what the pointer says of it."""

    name: str | None  # the newest verified checkpoint's folder; None: there is none
    pointer: str | None  # the pointer's text; None: there is no pointer
    note: str | None  # one line where the pointer disagrees with the folders, else None

    @property
    def agrees(self) -> bool:
        return self.note is None


def is_name(text: str) -> bool:
    """Whether ``text`` is a checkpoint's folder name (``step-00000012`` or
    ``step-00000012.2``), nothing else: no path, no ``..``."""
    return _NAME.fullmatch(text) is not None


def verified(root: Path) -> list[str]:
    """The checkpoints in ``root`` whose manifest reads and verifies and whose files are
    all present, oldest first (their bytes are verified when one is loaded)."""
    names = sorted((p.name for p in root.glob("step-*") if p.is_dir() and is_name(p.name)),
                   key=manifest.order)
    return [name for name in names if _complete(root / name)]


def _complete(target: Path) -> bool:
    try:
        found = manifest.read(target)
    except (CheckpointError, OSError):
        return False
    files = found.get("files")
    return isinstance(files, dict) and all((target / name).is_file() for name in files)


def newest(root: Path) -> Newest:
    """The newest verified checkpoint in ``root`` (``<out>/checkpoint``), and a line
    saying how the pointer disagrees with it, if it does."""
    pointer = manifest.latest(root)
    names = verified(root)
    name = names[-1] if names else None
    if pointer == name:
        return Newest(name, pointer, None)
    where = root / manifest.POINTER
    resumes = (f"the newest verified checkpoint, {name}, is used" if name else
               "there is no verified checkpoint")
    if pointer is None:
        said = f"{where} is missing"
    elif not pointer:
        said = f"{where} is empty"
    elif not is_name(pointer):
        outside = "/" in pointer or "\\" in pointer or pointer.startswith(".")
        said = (f"{where} names {pointer[:80]!r}, " + ("outside the folder of checkpoints"
                                                       if outside else "not a checkpoint"))
    elif pointer not in names:
        said = f"{where} names {pointer}, which is missing or incomplete"
    else:
        said = f"{where} names {pointer}, older than the newest (stale)"
    return Newest(name, pointer, f"{said}: {resumes} (the pointer is only a hint)")


def point_to(root: Path, name: str) -> None:
    """Makes checkpoint ``name`` the newest, in one move, flushed to disk: the folder it
    names is synced first, then the pointer's bytes, then the rename.

    Raises:
        OSError: the pointer could not be written; the folders decide without it.
    """
    durable.sync_folder(root / name)
    durable.sync_folder(root)
    temporary = root / manifest.POINTER_TEMPORARY
    durable.write_bytes(temporary, name.encode())
    durable.replace(temporary, root / manifest.POINTER)
