"""The runner writes into a run directory only once the fit has: a refused start changes no file there.

``fedfdp.fit`` checks every reason to refuse a start (a busy run directory, a resume that would
change the run, nothing left to train, a data or configuration error) before it writes a file of
the run directory; the first file it writes (``config.yaml``, when training starts) means it
accepted. The runner (:mod:`fedfdp.experiments.runner`) keeps the same rule with these helpers:

* :func:`snapshot`: the run directory's files (path, size, modification time), without the lock
  file ``run.lock`` that the fit creates and removes around its checks;
* :class:`StagedOutput`: the fit's output goes to a file outside the run directory until the
  run directory differs from its snapshot (the fit accepted the start), then it is appended to
  ``<run_dir>/fit.log`` and written there from then on (so ``fit.log`` can be followed while
  the run goes on); a fit that refused leaves its output outside (:meth:`StagedOutput.keep`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, BinaryIO

from fedfdp.rundir import LOCK_NAME

__all__ = ["StagedOutput", "snapshot"]


def snapshot(run_dir: Path) -> dict[str, tuple[int, int]]:
    """``{relative path: (size, mtime_ns)}`` of every file under ``run_dir`` but ``run.lock`` (empty: none)."""
    out: dict[str, tuple[int, int]] = {}
    if not run_dir.is_dir():
        return out
    for path in run_dir.rglob("*"):
        try:
            if path.name == LOCK_NAME or not path.is_file():
                continue
            st = path.stat()
        except OSError:  # removed while listed (a temporary file of the fit)
            continue
        out[str(path.relative_to(run_dir))] = (st.st_size, st.st_mtime_ns)
    return out


class StagedOutput:
    """The fit's output: staged outside the run directory until ``started()`` says the fit changed it.

    Give :attr:`stdout` to the subprocess; call :meth:`finish` once it has exited.

    Args:
        staged: the file outside the run directory that holds the output until then.
        final: ``<run_dir>/fit.log`` (appended to, never truncated).
        started: whether the fit has changed the run directory (checked at most every ``every`` s
            while output arrives, and once at the end).
    """

    def __init__(self, staged: Path, final: Path, started: Callable[[], bool], every: float = 0.5) -> None:
        self.staged, self.final, self.started, self.every = staged, final, started, every
        self.committed = False
        read, write = os.pipe()
        self.stdout: IO[str] = os.fdopen(write, "w")
        self._out: BinaryIO = open(staged, "ab")  # noqa: SIM115 - closed by finish
        self._thread = threading.Thread(target=self._pump, args=(read,), daemon=True)
        self._thread.start()

    def _pump(self, read: int) -> None:
        last = 0.0
        with os.fdopen(read, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                if not self.committed and time.monotonic() - last >= self.every:
                    last = time.monotonic()
                    if self.started():
                        self._commit()
                self._out.write(chunk)
                self._out.flush()

    def _commit(self) -> None:
        """Append what was staged to ``fit.log`` and write there from now on."""
        self._out.close()
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self._out = open(self.final, "ab")  # noqa: SIM115 - closed by finish
        self._out.write(self.staged.read_bytes())
        self._out.flush()
        self.staged.unlink()
        self.committed = True

    def finish(self) -> bool:
        """Once the fit has exited: all output written; whether it went to ``fit.log`` (the fit started)."""
        self.stdout.close()
        self._thread.join()
        if not self.committed and self.started():
            self._commit()
        self._out.close()
        return self.committed

    def keep(self, name: str) -> Path:
        """Move the staged output of a fit that refused to a file of its own in the system's temporary folder."""
        fd, kept = tempfile.mkstemp(prefix=f"fedfdp-refused-{name}-", suffix=".log")
        os.close(fd)
        shutil.move(str(self.staged), kept)
        return Path(kept)
