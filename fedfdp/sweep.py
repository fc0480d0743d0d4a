"""Many runs in one process: one per-sample pass serves every client of every run in a round.

A sweep trains ``R`` runs that share a model architecture and an algorithm (different seeds and
hyper-parameters). Each run is a complete ``fedfdp.fit`` run, built by the same command line
(:func:`fedfdp.cli.parser.build_cli`) and fitted by its own Lightning ``Trainer`` on its own
thread: its own random streams, accountant, privacy ledger, checkpoints, ``metrics.csv``,
``summary.json`` and ``report.md`` in its own run directory, exactly as ``fedfdp.fit`` writes
them. Only the arithmetic of the private steps is shared. Every round, each run's stacked round
(:mod:`fedfdp.stacked`) hands its clients' Poisson batches and start models to the
:class:`SweepBatcher` instead of its own engine; once every active run has handed its round in,
one grouped pass (:class:`fedfdp.grad_sample.grouped.GroupedNetwork`: each run's ``w_t``, or each
client's own model, is one group) gives every record's loss and gradient norm and every client's
clipped sum, and each run goes on with its own clip rules, noise, divisor, step, releases and
accounting. So a run's result is that of the same run alone, up to floating-point summation order.

A run that ends (budget spent, diverged, refused) leaves the rendezvous and the others go on; the
first SIGTERM/SIGINT (from the sweep's start, while its runs are still built) makes every run
checkpoint at its round boundary and stop (resume with ``--ckpt_path last``), a repeat within two
seconds is the same request, a later one stops the process at once. Python runs one thread at a time,
so the runs' bookkeeping (callbacks, logging) is serial; the batched pass is where the time goes.

Written by hand: Lightning runs one ``Trainer.fit`` per call and has no notion of batching the
arithmetic of several independent fits.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fedfdp.grad_sample.grouped import GroupedNetwork
from fedfdp.grad_sample.engine import PerSampleResult
from fedfdp.stacked import StackedRound, unstackable_reason
from fedfdp.types import ClientUpdate, LocalBatch, RoundContext, StackedStepSpec

if TYPE_CHECKING:
    from callbacks.interrupt import SweepStopRequest
    from fedfdp.cli.parser import FedFDPCLI
    from fedfdp.federation import Federation

logger = logging.getLogger(__name__)

__all__ = ["SweepBatcher", "SweepRun", "SweepStackedRound", "batch_refusal", "run_sweep"]


@dataclass
class _Request:
    """One run's engine pass of a round: its clients' start models and batches (in client order)."""

    starts: list[Tensor]
    batches: list[LocalBatch]
    result: PerSampleResult | None = None
    error: BaseException | None = None
    done: bool = False


class _RowsView(PerSampleResult):
    """One run's rows ``[lo, hi)`` of the union's result: its losses, norms and client sums."""

    def __init__(self, union: PerSampleResult, lo: int, hi: int) -> None:
        def segments(weights: Tensor, offsets: Sequence[int]) -> list[list[Tensor]]:
            full = torch.zeros(union.losses.shape[0], dtype=weights.dtype, device=weights.device)
            full[lo:hi] = weights
            return union.segment_weighted_sums(full, [lo + int(o) for o in offsets])

        def weighted(weights: Tensor) -> list[Tensor]:
            return segments(weights, [0, hi - lo])[0]

        super().__init__(union.losses[lo:hi], union.norms[lo:hi], weighted, segments)


class SweepBatcher:
    """The rendezvous of the runs' engine passes: one grouped pass when every active run has handed in.

    Args:
        grouped: the grouped network of the runs' common architecture.
    """

    def __init__(self, grouped: GroupedNetwork) -> None:
        self.grouped = grouped
        self._cond = threading.Condition()
        self._active: set[int] = set()
        self._pending: dict[int, _Request] = {}
        self.passes = 0

    def join(self, member: int) -> None:
        """``member`` takes part in the rendezvous until it :meth:`leave` s."""
        with self._cond:
            self._active.add(member)

    def leave(self, member: int) -> None:
        """``member`` has ended: the others no longer wait for it."""
        with self._cond:
            self._active.discard(member)
            self._maybe_run()

    def compute(self, member: int, starts: list[Tensor], batches: list[LocalBatch]) -> PerSampleResult:
        """``member``'s rows of the round's grouped pass (blocks until every active run has handed in)."""
        request = _Request(starts, batches)
        with self._cond:
            if member not in self._active:
                raise RuntimeError(f"sweep member {member} computes without having joined")
            self._pending[member] = request
            self._maybe_run()
            while not request.done:
                self._cond.wait()
        if request.error is not None:
            raise RuntimeError(f"the sweep's batched pass failed: {request.error}") from request.error
        assert request.result is not None
        return request.result

    def _maybe_run(self) -> None:
        """Run the pass once every active member has a pending request (called holding the lock).

        The pass runs on the thread of the last member to arrive; torch releases the GIL inside.
        """
        if not self._pending or set(self._pending) != self._active:
            return
        pending, self._pending = self._pending, {}
        try:
            self._run(pending)
        except BaseException as err:  # every waiting run must learn of it, not hang
            for request in pending.values():
                request.error = err
        for request in pending.values():
            request.done = True
        self._cond.notify_all()

    def _run(self, pending: dict[int, _Request]) -> None:
        starts, sizes, xs, ys, spans = [], [], [], [], []
        row = 0
        for member in sorted(pending):
            request = pending[member]
            lo = row
            bounds = [k for k in range(len(request.starts))
                      if k == 0 or request.starts[k] is not request.starts[k - 1]]
            for first, end in zip(bounds, [*bounds[1:], len(request.starts)]):
                starts.append(request.starts[first])
                sizes.append(sum(int(request.batches[k].y.shape[0]) for k in range(first, end)))
            xs.extend(b.x for b in request.batches)
            ys.extend(b.y for b in request.batches)
            row += sum(int(b.y.shape[0]) for b in request.batches)
            spans.append((member, lo, row))
        union = self.grouped.compute(torch.stack(starts), sizes, torch.cat(xs), torch.cat(ys))
        self.passes += 1
        for member, lo, hi in spans:
            pending[member].result = _RowsView(union, lo, hi)


class SweepStackedRound(StackedRound):
    """A run's stacked round whose engine pass is the sweep's shared one (all clients in one pass)."""

    def __init__(self, batcher: SweepBatcher, member: int) -> None:
        super().__init__(max_batch=None)
        self.batcher = batcher
        self.member = member

    def run(self, federation: Federation, spec: StackedStepSpec, client_ids: list[int],
            global_params: Tensor, context: RoundContext) -> list[ClientUpdate]:
        """Every client's step from one shared pass (no split into passes of ``max_batch``)."""
        starts = [federation.algorithm.client_start_params(cid, global_params, context) for cid in client_ids]
        return self._run_group(federation, spec, client_ids, starts)

    def _compute(self, federation: Federation, starts: list[Tensor], batches: list[LocalBatch]) -> PerSampleResult:
        return self.batcher.compute(self.member, starts, batches)


def batch_refusal(federation: Federation) -> str | None:
    """Why the sweep cannot batch this run's rounds (None: it can): the stacked round's conditions,
    and an algorithm whose first round has a stackable step."""
    reason = unstackable_reason(federation)
    if reason is not None:
        return reason
    spec = federation.algorithm.stackable_step(RoundContext(round=0))
    if spec is None or spec.lockstep:
        steps = getattr(getattr(federation.algorithm, "privacy", None), "local_steps", None)
        return (f"{type(federation.algorithm).__name__} has no one-step private update to batch (several local "
                f"steps{'' if steps is None else f': local_steps={steps}'}, its own local_update, or a non-private "
                f"algorithm)")
    return None


@dataclass
class SweepRun:
    """One run of a sweep.

    Attributes:
        name: its name (its directory under the sweep's output).
        args: its ``fedfdp.fit`` arguments.
        status: its exit status once it ended (as ``fedfdp.fit``'s), None before.
        seconds: its wall time.
        log: a file that receives the run's log records (its thread's), besides the process's log.
    """

    name: str
    args: list[str]
    status: int | None = None
    seconds: float = 0.0
    log: Path | None = None
    cli: Any = field(default=None, repr=False)


def _architecture(cli: FedFDPCLI) -> tuple[Any, ...]:
    """What runs that share one grouped network must agree on: the net's parameter shapes and
    trainability, its class, the client's loss and the device."""
    client = cli.model.client
    shapes = tuple((name, tuple(p.shape), p.requires_grad) for name, p in client.net.named_parameters())
    return (type(client.net).__qualname__, shapes, type(client).per_sample_loss, cli.trainer.strategy.root_device)


def run_sweep(runs: list[SweepRun], *, log_dir: Path | None = None) -> int:
    """Build every run, refuse what cannot be batched, fit them together; the sweep's exit status.

    Runs that fail to build (a refused start, e.g. a finished run resumed) get their ``error:``
    line and status and take no part. The exit status is 0 when every run ended with 0, else the
    largest status of a run (2 a refused run, 3 a diverged one, 128 + signal an interrupted sweep).
    """
    from datamodules.shared import shared_setups

    # the stop signals are the sweep's from its first line: one arriving while the runs are built
    # (seconds: data, checkpoints) stops them too, where it used to reach no run (or a handler above)
    from callbacks.interrupt import SweepStopRequest

    with shared_setups(), SweepStopRequest() as stop:  # one copy of the data for all runs that read it
        return _run_sweep(runs, stop)


def _run_sweep(runs: list[SweepRun], stop: SweepStopRequest) -> int:
    from callbacks.interrupt import exit_status
    from fedfdp.cli.parser import build_cli
    from fedfdp.fit import report_error

    built: list[SweepRun] = []
    for run in runs:
        try:
            run.cli = build_cli(run.args)
        except Exception as err:
            run.status = report_error(err, prefix=f"[{run.name}] ")
            continue
        built.append(run)
    if not built:
        return max((r.status or 0) for r in runs)
    batcher = _prepare(built)
    if batcher is None:  # refused (one error: line): no run is fitted
        for run in built:
            run.status = 2
        return 2
    if stop.signum is not None:  # stopped while the runs were built: none starts (nothing was released)
        logger.warning("sweep stopped by %s before its runs started: none was fitted",
                       signal.Signals(stop.signum).name)
        _release_all(built)
        for run in built:
            run.status = exit_status(stop.signum)
        return max((r.status or 0) for r in runs)
    return _fit_together(built, batcher, max((r.status or 0) for r in runs), stop)


def _prepare(built: list[SweepRun]) -> SweepBatcher | None:
    """Set every run up (data, algorithm) and give it the shared batcher; None after a refusal line."""
    first = built[0].cli
    for run in built:
        cli = run.cli
        reason = batch_refusal(cli.model)
        if reason is not None:
            print(f"error: sweep: run {run.name} cannot be batched: {reason}; run it with python -m fedfdp.fit "
                  f"(or the experiments runner) instead", file=sys.stderr)
            _release_all(built)
            return None
        if _architecture(cli) != _architecture(first):
            print(f"error: sweep: run {run.name} has another model, loss or device than run {built[0].name}; a sweep's "
                  f"runs share one architecture (vary seeds and hyper-parameters only)", file=sys.stderr)
            _release_all(built)
            return None
    client = first.model.client
    batcher = SweepBatcher(GroupedNetwork(client.net, client.per_sample_loss).to(first.trainer.strategy.root_device))
    for member, run in enumerate(built):
        run.cli.model._stacked = SweepStackedRound(batcher, member)
        run.cli.model.stacked_round = True
    return batcher


def _release_all(built: list[SweepRun]) -> None:
    """Give back the run directories' locks of runs that will not be fitted."""
    from fedfdp.cli.rundir_guard import RunDirGuard

    for run in built:
        for cb in run.cli.trainer.callbacks:
            if isinstance(cb, RunDirGuard) and cb.lock is not None:
                cb.lock.release()


def _fit_together(built: list[SweepRun], batcher: SweepBatcher, status: int, stop: SweepStopRequest) -> int:
    """Fit every run on its own thread; ``stop`` passes the stop signals on to every run."""
    from callbacks.interrupt import GracefulInterrupt
    from fedfdp.fit import fit_run

    stop.watch([cb for run in built for cb in run.cli.trainer.callbacks if isinstance(cb, GracefulInterrupt)])

    def fit(member: int, run: SweepRun) -> None:
        start = time.perf_counter()
        try:
            run.status = fit_run(run.cli, prefix=f"[{run.name}] ")
        except BaseException as err:  # a traceback of one run must not hang the others
            logger.exception("sweep run %s failed", run.name)
            run.status = 1
            del err
        finally:
            run.seconds = time.perf_counter() - start
            batcher.leave(member)

    handlers = [_thread_log(run) for run in built if run.log is not None]
    threads = []
    for member, run in enumerate(built):
        batcher.join(member)
    for member, run in enumerate(built):
        thread = threading.Thread(target=fit, args=(member, run), name=run.name, daemon=True)
        threads.append(thread)
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=0.5)  # wakes up for signals
    finally:
        for handler in handlers:
            logging.getLogger().removeHandler(handler)
            handler.close()
    logger.info("sweep: %d runs, %d batched passes", len(built), batcher.passes)
    return max([status, *((r.status or 0) for r in built)])


def _thread_log(run: SweepRun) -> logging.Handler:
    """A handler writing the log records of ``run``'s thread (named after the run) to ``run.log``."""
    assert run.log is not None
    handler = logging.FileHandler(run.log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(lambda record: record.threadName == run.name)
    logging.getLogger().addHandler(handler)
    return handler
