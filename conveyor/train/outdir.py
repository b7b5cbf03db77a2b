"""The ``--out`` folder of ``conveyor train``: checked before any work, used by one run
at a time (a lock), and a failed write said in one line.

Kept free of torch, like the options: a refused run stops before torch loads its model.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

from conveyor.errors import ConfigError
from conveyor.train.errors import SaveError

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; runs on one --out are not guarded there
    fcntl = None  # type: ignore[assignment]

__all__: list[str] = []

LOCK_FILE = ".lock"  # in --out while a run holds it: "<pid> <host>"


def check_usable(out: Path) -> None:
    """Raises ConfigError where ``out`` names a file, or a folder that cannot be created
    or written. Writes nothing: it only looks.

    Raises:
        ConfigError: as said, naming the path at fault and why.
    """
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder; choose another --out")
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    verb = "written" if existing == out else "created"
    if not existing.is_dir():
        raise ConfigError(f"--out {out} cannot be {verb}: {existing} is a file; choose "
                          "another --out")
    if not os.access(existing, os.W_OK | os.X_OK):
        why = ("is on a read-only file system" if _read_only(existing)
               else "is not writable (permission denied)")
        raise ConfigError(f"--out {out} cannot be {verb}: {existing} {why}; choose another "
                          "--out")


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # no statvfs (Windows)
        return False


class RunLock:
    """One run at a time in an ``--out`` folder: an exclusive ``flock`` on its ``.lock``.

    The system drops the lock when the holder's process ends, however it ends, so a
    killed run never leaves a stale lock (a ``.lock`` file left by a kill means nothing
    by itself). The file holds the holder's pid and host, for the refusal's message.
    :meth:`release` removes the file, and the folders :meth:`acquire` made if they are
    still empty: a run that stops on bad input after taking the lock leaves nothing. As a
    context manager it holds the lock for the block.
    """

    def __init__(self, out: Path) -> None:
        self.out = out
        self.path = out / LOCK_FILE
        self._handle: int | None = None
        self._made: list[Path] = []  # folders acquire() created, deepest last

    def acquire(self) -> None:
        """Takes the lock at once, or refuses.

        Raises:
            ConfigError: another process holds it (the message names its pid), or the
                folder cannot be created or written.
        """
        if self._handle is not None:
            return
        try:
            self._make_folder()
            while self._handle is None:
                self._handle = self._try_lock()
            os.ftruncate(self._handle, 0)
            os.write(self._handle, f"{os.getpid()} {socket.gethostname()}\n".encode())
        except OSError as exc:
            self.release()
            raise ConfigError(f"--out {self.out} cannot be written: "
                              f"{exc.strerror or exc}; choose another --out") from exc
        except BaseException:
            self.release()
            raise

    def acquire_together(self, *, writer: bool, agree: Callable[[int], int]) -> None:
        """For a run of several processes (torchrun): the one that writes takes the
        lock, and every one stops when it is refused (the writer's error says why).

        Args:
            writer: this process writes into ``--out`` (rank 0).
            agree: the largest of a value over every process (a collective: all call it).

        Raises:
            ConfigError: another run holds ``--out``.
        """
        refusal = None
        if writer:
            try:
                self.acquire()
            except ConfigError as exc:
                refusal = exc
        refused = agree(int(refusal is not None))
        if refusal is not None:
            raise refusal
        if refused:
            raise ConfigError(f"--out {self.out} is in use by another run (rank 0 says which)")

    def _make_folder(self) -> None:
        missing = []
        folder = self.out
        while not folder.exists() and folder != folder.parent:
            missing.append(folder)
            folder = folder.parent
        self.out.mkdir(parents=True, exist_ok=True)
        self._made = missing[::-1]

    def _try_lock(self) -> int | None:
        """The locked file's handle; None when the file was replaced while this waited
        for it (its holder removed it on release), so that the caller tries again.

        Raises:
            ConfigError: another process holds the lock.
        """
        handle = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is None:
            return handle
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(handle, 200).decode(errors="replace").split()
            os.close(handle)
            raise ConfigError(f"{self.out} is in use by another conveyor train"
                              f"{_describe(holder)}; wait for it to end, or choose another "
                              "--out") from None
        try:
            current = os.stat(self.path)
        except FileNotFoundError:
            current = None
        opened = os.fstat(handle)
        if current is None or (current.st_dev, current.st_ino) != (opened.st_dev,
                                                                   opened.st_ino):
            os.close(handle)  # a lock on a file nobody else will find
            return None
        return handle

    def release(self) -> None:
        """Lets the lock go; removes ``.lock``, and the folders made for it if empty."""
        if self._handle is not None:
            # Removed while still held: a process that opened it meanwhile finds, once it
            # has the lock, that the name is gone, and starts over (see _try_lock).
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(self._handle)
            self._handle = None
        for folder in reversed(self._made):
            try:
                folder.rmdir()
            except OSError:  # not empty: the run wrote something
                break
        self._made = []

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.release()


def _describe(holder: list[str]) -> str:
    """`` (pid 123)``, `` (pid 123 on host)`` when another machine holds it, or nothing
    when the holder has not written its pid yet."""
    if not holder or not holder[0].isdigit():
        return ""
    if len(holder) > 1 and holder[1] != socket.gethostname():
        return f" (pid {holder[0]} on {holder[1]})"
    return f" (pid {holder[0]})"


@contextlib.contextmanager
def writing(what: str, out: Path, intact: str) -> Iterator[None]:
    """Turns a failed write of ``what`` into ``out`` (an ``OSError``: a full disk, a lost
    mount) into a SaveError of one line ending with ``intact``, what survived.

    Raises:
        SaveError: the write failed; the ``OSError`` is its ``__cause__``.
    """
    try:
        yield
    except BaseException as exc:
        cause = _write_failure(exc)
        if cause is None:
            raise
        raise SaveError(f"could not save {what} to {out}: {cause.strerror or cause}; "
                        f"{intact}") from exc


def _write_failure(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``: itself, or under torchrun the first that a rank met
    in ``torch.distributed.checkpoint.save`` (which gathers them into a
    ``CheckpointException``, a BaseException)."""
    if isinstance(exc, OSError):
        return exc
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:
        return None
    if isinstance(exc, CheckpointException):
        for failure, _ in exc.failures.values():
            if isinstance(failure, OSError):
                return failure
    return None
