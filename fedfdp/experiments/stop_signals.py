"""Stopping a harness without cutting a round: SIGINT/SIGTERM pass on to the running fits, which end
their round, and no further run starts.

A fit stopped by one signal finishes the round in progress, checkpoints and exits ``128 + signal``
(:class:`callbacks.GracefulInterrupt`). A fit killed mid-round instead has charged that round's
releases in its privacy ledger (fail-closed: they were made) and makes them again when it resumes,
so every cut costs a round of budget: measured on the RC-DPFL paper-setting runs, a seed cut once
ended at 199 of its 200 rounds with the same ε. Without this module a harness cut its fits:
``subprocess.run`` kills its child with SIGKILL when the waiting thread gets ``KeyboardInterrupt``
(Ctrl-C), and Python's default SIGTERM ends the harness at once, leaving the stop to whatever
kills the orphaned fit next.

Here, while :func:`installed` is active (the main thread of a harness), the first SIGINT or SIGTERM
is passed on to every fit launched through :func:`launch` (a fit that got the same signal from its
process group sees the copy within :data:`callbacks.interrupt.REPEAT_WINDOW_S` and takes both as one
request), the harness waits for them, and :func:`check` raises :class:`HarnessInterrupted` before
any further run starts; ``python -m fedfdp.experiments`` then exits ``128 + signal`` and the same
command resumes. A second signal, passed on as well, stops the fits at once. :func:`run_in_pool`
is the loop of a harness that asks for each next run as a worker frees (``tune``): a stopped run's
item is left unrecorded and no further item is asked for.

Written by hand: neither ``subprocess`` nor ``concurrent.futures`` forwards signals to children.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

__all__ = ["HarnessInterrupted", "check", "installed", "launch", "run_in_pool", "stopped_fit"]

logger = logging.getLogger(__name__)

#: The signals a harness passes on to its fits (SIGHUP: ``nohup`` harnesses ignore it).
FORWARDED = (signal.SIGINT, signal.SIGTERM)


class HarnessInterrupted(Exception):
    """A stop signal arrived: the running fits ended (checkpointed) and no further run was started."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        super().__init__(f"interrupted by {signal.Signals(signum).name}: the running fits finished their round and "
                         f"checkpointed, no further run was started; run the same command again to resume")


class _State:
    """The process's stop state: the fits running, the signal received, the installed handlers."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # re-entrant: the handler may run in the main thread while it holds it
        self.children: set[subprocess.Popen[Any]] = set()
        self.signum: int | None = None
        self.depth = 0
        self.previous: dict[int, Any] = {}


_state = _State()


def _handle(signum: int, frame: Any) -> None:
    with _state.lock:
        first = _state.signum is None
        _state.signum = signum
        children = list(_state.children)
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)
    logger.warning("received %s: %s %d running fit(s)%s", signal.Signals(signum).name,
                   "passed on to" if first else "passed on again (they stop at once) to", len(children),
                   "; they end their round and checkpoint, and no further run starts (send it again to stop them "
                   "at once)" if first else "")


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Pass SIGINT/SIGTERM on to the running fits while active (nestable; the main thread installs
    the handlers, other threads only use them). The stop state is cleared when the outermost exits."""
    main = threading.current_thread() is threading.main_thread()
    with _state.lock:
        _state.depth += 1
        outermost = _state.depth == 1
    if outermost and main:
        for sig in FORWARDED:
            previous = signal.getsignal(sig)
            if previous != signal.SIG_IGN:  # an inherited ignore (a background job's SIGINT) stays
                _state.previous[sig] = previous
                signal.signal(sig, _handle)
    try:
        yield
    finally:
        with _state.lock:
            _state.depth -= 1
            last = _state.depth == 0
            if last:
                _state.signum = None
        if last:
            for sig, previous in _state.previous.items():
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            _state.previous.clear()


def check() -> None:
    """Raise :class:`HarnessInterrupted` when a stop signal has arrived (before a run starts)."""
    signum = _state.signum
    if signum is not None:
        raise HarnessInterrupted(signum)


def stopped_fit(returncode: int, summary: Mapping[str, Any] | None) -> int | None:
    """The signal that stopped a fit at a round boundary (exit ``128 + SIGINT/SIGTERM`` and
    ``summary.json`` status ``interrupted``: :class:`callbacks.GracefulInterrupt`), else None.

    Such a fit is resumable, not failed, also when the signal was sent to it alone (a user's
    ``kill``, a scheduler): a harness stops as if it had got the signal itself, so the run (and a
    study's trial) is continued by the same command rather than recorded as failed."""
    signum = returncode - 128
    if signum in FORWARDED and (summary or {}).get("status") == "interrupted":
        return signum
    return None


def launch(cmd: Sequence[str], **popen: Any) -> int:
    """Run ``cmd`` to its end (``subprocess.Popen(cmd, **popen)``), passing stop signals on to it;
    its exit status. Refuses to start once a stop signal has arrived (:func:`check`)."""
    with installed():
        arrived: int | None = None
        with _state.lock:
            signum = _state.signum
            if signum is None:
                proc = subprocess.Popen(list(cmd), **popen)
                _state.children.add(proc)
                arrived = _state.signum  # a signal handled while Popen ran (in this thread) missed the child
        if signum is not None:
            raise HarnessInterrupted(signum)
        try:
            if arrived is not None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(arrived)
            return proc.wait()
        finally:
            with _state.lock:
                _state.children.discard(proc)


def run_in_pool(jobs: int, next_item: Callable[[], Any], run_item: Callable[[Any], Any],
                 record: Callable[[Any, Any], None]) -> None:
    """Run the items ``next_item()`` gives (until None), ``jobs`` at a time on worker threads that
    each launch a fit, and ``record`` each result in the calling thread (in the order given, among
    those ending together). A study's loop (:mod:`fedfdp.experiments.tune`): it asks for each new
    item when a slot frees, which :meth:`Runner.run_all`'s fixed list cannot.

    A stop signal (the caller holds :func:`installed`, in the main thread): the running fits end
    their round and checkpoint, their items are not recorded (a trial stays RUNNING, and the next
    invocation finishes it from its checkpoint), no further item is asked for, and
    :class:`HarnessInterrupted` is raised once they have all ended.
    """
    stopped: HarnessInterrupted | None = None
    running: dict[Future[Any], tuple[int, Any]] = {}
    given = 0
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        while True:
            while stopped is None and len(running) < jobs:
                try:
                    check()  # stopped: no further item is asked for
                except HarnessInterrupted as err:
                    stopped = err
                    break
                item = next_item()
                if item is None:
                    break
                running[pool.submit(run_item, item)] = (given, item)
                given += 1
            if not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: running[f][0]):
                _, item = running.pop(future)
                try:
                    result = future.result()
                except HarnessInterrupted as err:
                    stopped = err
                    continue
                record(item, result)
    if stopped is not None:
        raise stopped
