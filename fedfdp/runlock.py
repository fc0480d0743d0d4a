"""One process per run directory: an exclusive lock on ``RUN_DIR/run.lock`` (:class:`RunLock`).

The command line (:mod:`fedfdp.cli.parser`) takes it before it writes anything and holds it for
the whole fit (:class:`fedfdp.cli.rundir_guard.RunDirGuard`); the experiment runner checks it
before it starts a run (:meth:`RunLock.check_free`). Only the standard library and
:mod:`fedfdp.errors` are imported here (no torch).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import weakref
from pathlib import Path

from fedfdp.errors import ConfigError
from fedfdp.rundir import LOCK_NAME

__all__ = ["RunLock"]


def _read_holder(fd: int) -> str:
    """The holder description written in a lock file (``pid N on host H``), or ``unknown``."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {info['pid']} on host {info['host']}, since {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "pid unknown"


def _busy(run_dir: Path, holder: str) -> ConfigError:
    return ConfigError(f"run_dir {run_dir} is in use by another run ({holder}; lock {run_dir / LOCK_NAME}); "
                       f"wait for it to end or choose another --run_dir")


def _release(path: Path, fd: int, created: list[Path], owner: int) -> None:
    """Remove the lock file (still holding the lock), close it, and the empty directories we made.

    Only in the process that took the lock: a forked child that exits leaves it alone.
    """
    if os.getpid() != owner:
        return
    try:
        if os.path.samestat(os.fstat(fd), os.stat(path)):
            path.unlink()
    except OSError:
        pass
    os.close(fd)
    _remove_empty(created)  # a start that wrote nothing else leaves no trace


def _remove_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (deepest first) as long as they are empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


class RunLock:
    """Exclusive ``fcntl.flock`` of ``RUN_DIR/run.lock`` (pid, host and start time inside).

    The lock belongs to an open file descriptor, so the kernel releases it when the process
    exits, however it exits: a lock file left by a SIGKILLed process does not block. A
    released lock's file is removed; a locker that opened it before the removal notices (the
    path then names another file or none) and tries again.

    Args:
        run_dir: the run directory (created by :meth:`acquire` if missing; removed again by
            :meth:`release` if it is then empty).
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._finalizer: weakref.finalize | None = None

    @staticmethod
    def check_free(run_dir: Path) -> None:
        """Raise :class:`ConfigError` if another process holds ``run_dir``'s lock (changes no file)."""
        path = Path(run_dir) / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _busy(Path(run_dir), _read_holder(fd)) from None
        finally:
            os.close(fd)

    def acquire(self) -> RunLock:
        """Take the lock (creating the directory); :class:`ConfigError` if busy or not writable."""
        created = [d for d in (self.run_dir, *self.run_dir.parents) if not d.exists()]  # deepest first
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            while True:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = _read_holder(fd)
                    os.close(fd)
                    raise _busy(self.run_dir, holder) from None
                try:
                    if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                        break
                except FileNotFoundError:
                    pass
                os.close(fd)  # released and removed between our open and flock: lock the new file
        except OSError as err:
            _remove_empty(created)
            strerror = err.strerror or os.strerror(err.errno or errno.EIO)
            raise ConfigError(f"run_dir {self.run_dir} is not writable: {strerror}") from err
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        # released at the latest when this object is collected or the interpreter exits
        self._finalizer = weakref.finalize(self, _release, self.path, fd, created, os.getpid())
        return self

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._finalizer is not None and self._finalizer.alive

    def release(self) -> None:
        """Release the lock and remove its file (and the directory, if this lock created it and it is empty)."""
        if self._finalizer is not None:
            self._finalizer()

