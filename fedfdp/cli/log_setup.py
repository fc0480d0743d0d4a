"""Logging of the command-line entry points (``fedfdp.fit``, the Flower apps): our packages' INFO
lines on stderr, known third-party noise filtered, quiet ranks > 0."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any


def is_launched_process() -> bool:
    """Whether this process was started by Lightning's DDP launcher for a rank other than 0."""
    return any(int(os.environ.get(var, "0") or 0) > 0 for var in ("LOCAL_RANK", "NODE_RANK"))


class StderrHandler(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stderr`` is when a record is emitted.

    A plain ``StreamHandler`` keeps the stream it was made with: when the first run of a process
    is made under a replaced ``sys.stderr`` (a test's captured output, a harness's redirect) and
    that stream is closed afterwards, every later record fails with "I/O operation on closed
    file" and logging prints a traceback in the middle of the next run's output.
    """

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ assigns one: sys.stderr is read at emit time
        pass


def configure_logging() -> None:
    """INFO logs of our packages on stderr (Lightning keeps its own handler), known noise filtered."""
    handler = StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    for name in ("fedfdp", "callbacks", "datamodules"):
        log = logging.getLogger(name)
        if not log.handlers:
            log.addHandler(handler)
        # processes launched for ranks > 0 repeat rank 0's lines: they report warnings only
        log.setLevel(logging.WARNING if is_launched_process() else logging.INFO)
        log.propagate = False  # a root handler installed by a dependency would print every line twice
    # Saving the post-step state is what we want: a checkpoint at step t holds w_t after round t.
    warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)")
    warnings.filterwarnings("ignore", message=".*does not have many workers")
    # The round index is global_step, restored from the checkpoint; the rounds loader has no state.
    warnings.filterwarnings("ignore", message=".*your dataloader is not resumable")
    # A resume reuses its own checkpoints/ folder, checked and locked first (fedfdp.rundir): expected.
    warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
    # An advertisement Lightning prints on every run.
    lightning_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropAdvert) for f in lightning_log.filters):
        lightning_log.addFilter(_DropAdvert())


class _DropAdvert(logging.Filter):
    """Drops Lightning's "Tip: ... try installing litlogger" line."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Keep every record but the advertisement."""
        return "litlogger" not in str(record.msg)
