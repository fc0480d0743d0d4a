"""The run directory during a fit: its lock (:class:`RunDirGuard`), what a stopped run keeps (:func:`kept_files`).

The directory is checked and locked before the trainer is built (:mod:`fedfdp.cli.parser`,
:class:`fedfdp.runlock.RunLock`); the guard, one of the trainer's callbacks, releases it when
fitting ends or fails.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from fedfdp.rundir import CHECKPOINTS_DIR, SUMMARY_NAME, RunPaths
from fedfdp.runlock import RunLock

logger = logging.getLogger("fedfdp")

__all__ = ["RunDirGuard", "kept_files"]


class RunDirGuard(Callback):
    """Holds the run directory's lock for the whole fit and releases it when fitting ends or fails.

    The loggers are flushed first, so every file of the run is written while the directory is
    locked. When a run fails after training started (divergence, interruption) it logs what the
    run directory keeps: the checkpoints and ``summary.json`` of the rounds before, if any.

    Args:
        run_dir: the run directory.
        lock: its lock (``None`` in processes that Lightning's DDP launcher started for ranks > 0).
    """

    def __init__(self, run_dir: Path, lock: RunLock | None) -> None:
        self.run_dir = run_dir
        self.lock = lock
        self._training = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """From here on the run directory holds this run's files."""
        self._training = True

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Say what the run directory keeps, then release it."""
        if self._training and trainer.is_global_zero:
            logger.warning("%s", kept_files(self.run_dir))
        self._release(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Release the run directory at the end of fitting."""
        self._release(trainer)

    def _release(self, trainer: Trainer) -> None:
        try:
            for lg in trainer.loggers:
                lg.save()
        except OSError as err:  # a full disk: the metrics stay as last saved, the lock goes all the same
            logger.warning("the loggers could not save (%s)", err)
        finally:
            if self.lock is not None:
                self.lock.release()


def kept_files(run_dir: Path) -> str:
    """One line on what a stopped run left in ``run_dir``: its checkpoints and ``summary.json``, if any."""
    paths = RunPaths(run_dir)
    folder = paths.checkpoints
    checkpoints = sorted(p.name for p in folder.glob("*.ckpt")) if folder.is_dir() else []
    ckpt = f"{CHECKPOINTS_DIR}/{', '.join(checkpoints)}" if checkpoints else "no checkpoint"
    try:
        rounds = json.loads(paths.summary.read_text()).get("rounds_run")
        summary = f"{SUMMARY_NAME} (after round {rounds})"
    except (OSError, ValueError):
        summary = f"no {SUMMARY_NAME}"
    hint = " (no round was saved before it stopped)" if not checkpoints and summary.startswith("no") else ""
    return f"run_dir {run_dir} keeps {ckpt} and {summary}{hint}"
