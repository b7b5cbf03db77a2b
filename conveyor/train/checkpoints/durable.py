"""Writes that survive a power loss: a file's bytes and its name are on disk (fsync of
the file, then of its folder) before anything that depends on them is written."""

from __future__ import annotations

import os
from pathlib import Path

__all__: list[str] = []


def sync_folder(folder: Path) -> None:
    """Flushes ``folder``'s entries (the names created, renamed or removed in it) to disk.
    A file system that cannot open a folder for reading (some network ones) is left as
    it is: its own guarantees hold there."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass  # a folder that cannot be synced (EINVAL on some file systems)
    finally:
        os.close(handle)


def sync_file(path: Path) -> None:
    """Flushes the bytes of the file at ``path`` to disk."""
    with open(path, "rb+") as file:
        os.fsync(file.fileno())


def write_bytes(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` and flushes it, then its folder, to disk.

    Raises:
        OSError: it could not be written (a full disk, a read-only file system).
    """
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    sync_folder(path.parent)


def replace(source: Path, target: Path) -> None:
    """Renames ``source`` to ``target`` in one move, the rename flushed to disk."""
    os.replace(source, target)
    sync_folder(target.parent)
