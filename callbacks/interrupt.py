"""Stopping a run on SIGTERM or SIGINT at a round boundary, with a checkpoint and the truth.

A cluster scheduler (or ``timeout``) sends SIGTERM before it kills a job; Ctrl-C sends SIGINT.
Lightning's own handling ends ``fit`` as if the run had finished (SIGTERM: exit status 0) or
exits without a checkpoint (SIGINT). Here the first signal lets the round in progress finish
(its releases are already charged), then the run saves ``checkpoints/last.ckpt``, writes
``summary.json`` with ``status: interrupted`` and stops; the command then exits with
``128 + signal`` (130 for SIGINT, 143 for SIGTERM), and ``--ckpt_path last`` continues the run to
the same end as an uninterrupted one (every random stream is keyed by round and client). A
second signal stops at once (``KeyboardInterrupt``), as the shell user who presses Ctrl-C twice
expects, unless it comes within :data:`REPEAT_WINDOW_S` of the first: a stop request often arrives
twice (a process group's signal, and the harness above passing the same signal on,
:mod:`fedfdp.experiments.stop_signals`), and a stop at once cuts the round, whose releases then
stay charged and are made again on resume.

Written by hand: Lightning has no callback that checkpoints on a signal outside SLURM requeueing.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

logger = logging.getLogger(__name__)

#: The signals that stop a run gracefully (SIGHUP: the terminal closed). A signal the process
#: inherited as ignored (``nohup`` ignores SIGHUP, a shell's background job SIGINT) stays ignored.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


#: A repeat of the stop signal within this many seconds of the first is the same request (module docstring).
REPEAT_WINDOW_S = 2.0


def repeats(first_at: float) -> bool:
    """Whether a stop signal now repeats the request first made at ``first_at`` (``time.monotonic()``)."""
    return time.monotonic() - first_at < REPEAT_WINDOW_S


def exit_status(signum: int) -> int:
    """The shell's exit status of a process stopped by ``signum`` (130 SIGINT, 143 SIGTERM, 129 SIGHUP)."""
    return 128 + int(signum)


class GracefulInterrupt(Callback):
    """On SIGTERM/SIGINT: finish the round, checkpoint, stop with ``status: interrupted``.

    The signal received is kept in ``federation.stop_signal`` (read by :class:`callbacks.RunSummary`
    and by the command line for the exit status).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._first_at = 0.0  # time.monotonic() of the first signal
        self._previous: dict[int, Any] = {}
        self._module: LightningModule | None = None

    # ---- handlers -------------------------------------------------------------------------------
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # the second signal: stop now, unless it repeats the first request
            if repeats(self._first_at):
                logger.info("received %s again within %.0f s: the same stop request (still stopping after the round)",
                            signal.Signals(signum).name, REPEAT_WINDOW_S)
                return
            self._restore()
            if self._module is not None:
                self._module.stop_signal = signum  # type: ignore[assignment]
            raise KeyboardInterrupt
        self.signum = signum
        self._first_at = time.monotonic()
        logger.warning("received %s: stopping after the round in progress (checkpoint, summary with status "
                       "interrupted); send it again (after %.0f s) to stop at once", signal.Signals(signum).name,
                       REPEAT_WINDOW_S)

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (e.g. a run inside a worker)
        for sig in STOP_SIGNALS:
            previous = signal.getsignal(sig)
            if previous == signal.SIG_IGN:
                continue
            self._previous[sig] = previous
            signal.signal(sig, self._handle)

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    # ---- Lightning hooks ------------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Install the handlers (after Lightning's, which would end the run as if it had finished).

        A request that came before (a sweep passes one on to runs still starting) is kept: the run
        stops after its first round."""
        self._module = pl_module
        self._install()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """At the round boundary after a signal: checkpoint and stop (all processes agree)."""
        stop = trainer.strategy.reduce_boolean_decision(self.signum is not None, all=False)
        if not stop:
            return
        last_round = getattr(pl_module, "total_rounds", None)
        if last_round is not None and trainer.global_step >= last_round:
            # the signal came during the run's last round: the run ends as planned (its checkpoint, its
            # summary) rather than as an interrupted run that a resume would find with nothing left to train
            logger.warning("%s came during the last round (%d): the run ends as planned",
                           signal.Signals(self.signum or signal.SIGTERM).name, trainer.global_step)
            return
        pl_module.stop_signal = self.signum if self.signum is not None else int(signal.SIGTERM)  # type: ignore[assignment]
        path = self.checkpoint_path(trainer)
        if path is not None:
            trainer.save_checkpoint(path)
            logger.warning("interrupted after round %d: checkpoint %s; resume with --ckpt_path last",
                           trainer.global_step, path)
        trainer.should_stop = True

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Give the signals back to their previous handlers; the next fit starts with no request."""
        self._restore()
        self.signum = None

    @staticmethod
    def checkpoint_path(trainer: Trainer) -> Path | None:
        """``last.ckpt`` in the run's checkpoint folder (what ``--ckpt_path last`` resumes from)."""
        checkpoints = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
        if not checkpoints:
            return None
        cb = checkpoints[0]
        return Path(str(cb.dirpath)) / f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}"


class SweepStopRequest:
    """A sweep's (:mod:`fedfdp.sweep`) SIGINT/SIGTERM/SIGHUP, from before its runs are built until
    they have all ended: :class:`GracefulInterrupt`'s request for many runs in one process.

    The first makes every run stop after its round in progress (checkpoint, status interrupted; a
    run not fitting yet does not start); a repeat within :data:`REPEAT_WINDOW_S` is the same request (a process group's signal and a harness's copy), a later one stops the
    process at once (``KeyboardInterrupt``). Installed from the main thread only (a sweep run in a
    worker thread leaves the signals to that process's main thread).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._first_at = 0.0
        self._interrupts: list[Any] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SweepStopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                if signal.getsignal(sig) != signal.SIG_IGN:  # an inherited ignore (nohup's SIGHUP) stays
                    self._previous[sig] = signal.getsignal(sig)
                    signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            if repeats(self._first_at):
                return  # the same request
            self._restore()
            raise KeyboardInterrupt
        self.signum, self._first_at = signum, time.monotonic()
        logger.warning("received %s: every run of the sweep stops after its round in progress (checkpoint, "
                       "status interrupted); send it again (after %.0f s) to stop at once",
                       signal.Signals(signum).name, REPEAT_WINDOW_S)
        for cb in self._interrupts:
            cb.signum = signum

    def watch(self, interrupts: list[Any]) -> None:
        """Pass the request on to these runs' :class:`callbacks.GracefulInterrupt` (now, if it came)."""
        self._interrupts = interrupts
        if self.signum is not None:
            for cb in interrupts:
                cb.signum = self.signum
