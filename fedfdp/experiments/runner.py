"""The one experiment runner: launch ``fedfdp.fit`` runs, skip finished ones, resume interrupted ones.

Every experiment command (``finp-table``, ``rcdpfl-table``, ``paper-table*``, ``tune``) plans its
runs as :class:`RunSpec` values and hands them to a :class:`Runner`, which for each run

* skips it when its ``summary.json`` says it finished (:func:`fedfdp.experiments.results.is_finished`:
  status ``completed`` or ``budget_spent``, no client left out) with the configuration the spec asks
  for; a finished run whose saved ``config.yaml`` differs from it in anything that changes the run
  (:func:`fedfdp.experiments.provenance.saved_config_differences`) is refused with one ``error:`` line
  (result ``failed``): its numbers are not the asked run's, and it is left as it is;
* leaves alone, with one ``error:`` line, a run that ran every round with clients left out
  (``*_with_missing_clients``: a resume cannot add them; result ``incomplete``), and a run
  directory another process holds (result ``failed``);
* resumes it with ``--ckpt_path last`` when it has ``checkpoints/last.ckpt``;
* moves a run that left results but no checkpoint (stopped before its first checkpoint) aside
  to ``<run_dir>.stale-<unix time>`` and starts it again (``fedfdp.fit`` refuses to start over
  results), and moves it back if the fit then refuses to start;
* otherwise starts it: one subprocess ``[nice -n N] python -m fedfdp.fit --config C --run_dir D
  [--seed_everything K] ARGS --checkpoint_every 1 [--ckpt_path last]``.

``--checkpoint_every 1`` (unless ARGS set it): these runs are long and get killed (a session's
end, a preempted job). A resumed run replays the rounds since its last checkpoint, and the
crash-proof ledger keeps their first releases charged, so with the fit's default (a checkpoint
every ``eval_every`` rounds) each kill cost up to ``eval_every − 1`` rounds of budget (measured: a
local DP-SGD run of Table V killed after round 45 with its checkpoint at 39 charged rounds 40-45
twice and ended at 177 of 183 rounds). A checkpoint a round costs nothing measurable for these
models (docs/privacy.md, ``benchmarks/checkpoint.py``). A stop signal does not cut a round at all:
the runner passes SIGINT/SIGTERM on to the running fit, which ends its round and checkpoints, then
starts no further run and raises :class:`~fedfdp.experiments.stop_signals.HarnessInterrupted`
(:mod:`fedfdp.experiments.stop_signals`); so does a fit stopped that way by a signal sent to it
alone (it is resumable, not failed).

Like ``fedfdp.fit``, the runner changes no file of the run directory before the fit has accepted
the start (:mod:`fedfdp.experiments.staging`): a config the spec makes (:attr:`RunSpec.make_config`)
for a file inside the run directory, and the fit's output, are staged outside it; once the fit
has changed the run directory the config takes its place, the output is appended to
``<run_dir>/fit.log`` (and goes there from then on), and the command, exit status and wall time
are written to ``<run_dir>/harness.json``. A fit that refused leaves them out
(:attr:`RunResult.log` is then a file in the system's temporary folder).

Reading the results back and tabulating them is :mod:`fedfdp.experiments.results`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from fedfdp.errors import ConfigError
from fedfdp.experiments.provenance import saved_config_differences
from fedfdp.experiments._common import print_command
from fedfdp.experiments.results import ended_with_missing_clients, is_finished, read_summary, recorded_wall_seconds
from fedfdp.experiments import stop_signals
from fedfdp.experiments.staging import StagedOutput, snapshot
from fedfdp.participation import rounds_phrase
from fedfdp.rundir import LOG_NAME, RunPaths, run_files
from fedfdp.runlock import RunLock

__all__ = ["DEFAULT_ENV", "RunResult", "RunSpec", "Runner", "last_error_line"]

logger = logging.getLogger(__name__)

#: Environment defaults of every run (a value the caller's environment sets wins).
DEFAULT_ENV: dict[str, str] = {"OMP_WAIT_POLICY": "PASSIVE"}


@dataclass(frozen=True)
class RunSpec:
    """One ``fedfdp.fit`` run.

    Attributes:
        run_dir: the run directory (``--run_dir``).
        config: the config file (``--config``).
        seed: ``--seed_everything`` (None: the config's).
        args: further ``fedfdp.fit`` arguments (overrides), after the seed.
        make_config: when given, its result is the YAML of ``config`` for the run (not made for
            a finished run, nor for a dry run): written before the launch when ``config`` is
            outside the run directory, else staged and put in place once the fit has started.
    """

    run_dir: Path
    config: Path
    seed: int | None = None
    args: tuple[str, ...] = ()
    make_config: Callable[[], Mapping[str, Any]] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class RunResult:
    """What became of one run: ``skipped`` (already finished), ``ran`` (exit 0), ``failed``, or
    ``incomplete`` (it ran every round with clients left out: not run again, not a finished run).
    ``wall_seconds``: this launch's, or for a skipped run the one its ``harness.json`` recorded;
    ``refusal``: the runner's ``error:`` line for a run it did not launch."""

    spec: RunSpec
    status: Literal["skipped", "ran", "failed", "incomplete"]
    returncode: int = 0
    wall_seconds: float = 0.0
    summary: dict[str, Any] | None = None
    log_file: Path | None = None
    refusal: str | None = None

    @property
    def error_line(self) -> str:
        """Why the run failed: the runner's refusal (a run not launched), else its log's last ``error:`` line."""
        return self.refusal or last_error_line(self.log)

    @property
    def finished(self) -> bool:
        """Whether the run has finished (skipped as such, or ran to its end)."""
        return is_finished(self.summary)

    @property
    def log(self) -> Path:
        """The run's ``fit.log``, or where the output of a fit that refused to start was kept."""
        return self.log_file or RunPaths(self.spec.run_dir).log


def last_error_line(log: Path) -> str:
    """The last ``error:`` line of a fit log (or its last line)."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["empty log"])[-1]


def resumable(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` has a checkpoint to resume from (``checkpoints/last.ckpt``)."""
    return RunPaths(run_dir).last_checkpoint.exists()


@dataclass(frozen=True)
class Runner:
    """Launches :class:`RunSpec` runs as ``fedfdp.fit`` subprocesses (see the module docstring).

    Attributes:
        env: environment variables every run gets (over the caller's environment).
        env_defaults: environment variables a run gets unless the caller's environment sets them.
        niceness: run under ``nice -n niceness`` (0: not niced).
    """

    env: Mapping[str, str] = field(default_factory=dict)
    env_defaults: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_ENV))
    niceness: int = 0

    def command(self, spec: RunSpec, config: Path | None = None) -> list[str]:
        """The command line of ``spec`` as it would run now (resuming when it has a checkpoint);
        ``config``: the file the fit reads instead of ``spec.config`` (a staged one)."""
        cmd = ["nice", "-n", str(self.niceness)] if self.niceness else []
        cmd += [sys.executable, "-m", "fedfdp.fit", "--config", str(config or spec.config), "--run_dir",
                str(spec.run_dir)]
        if spec.seed is not None:
            cmd += ["--seed_everything", str(spec.seed)]
        cmd += list(spec.args)
        if not any(arg.split("=", 1)[0] == "--checkpoint_every" for arg in spec.args):
            cmd += ["--checkpoint_every", "1"]  # a kill replays (and charges again) at most the round it cut
        if resumable(spec.run_dir):
            cmd += ["--ckpt_path", "last"]
        return cmd

    def pending(self, specs: Iterable[RunSpec]) -> list[RunSpec]:
        """The runs of ``specs`` that have not finished (and did not end with clients left out); for a
        finished run of another configuration its ``error:`` line is logged (:meth:`other_configuration`)."""
        return self._plan(specs)[0]

    def dry_run(self, specs: Iterable[RunSpec]) -> int:
        """A harness's ``--dry-run``: print the command of every run of ``specs`` that would run;
        the exit status, 1 when a finished run trained another configuration (its ``error:`` line
        logged; the run itself refuses it and fails), else 0."""
        todo, other = self._plan(specs)
        for spec in todo:
            print_command(self.command(spec))
        return 1 if other else 0

    def _plan(self, specs: Iterable[RunSpec]) -> tuple[list[RunSpec], list[RunSpec]]:
        """(the runs to launch, the finished runs of another configuration than their spec's)."""
        todo, other = [], []
        for spec in specs:
            summary = read_summary(spec.run_dir)
            if is_finished(summary):
                if self.other_configuration(spec) is not None:
                    other.append(spec)
            elif not ended_with_missing_clients(summary):
                todo.append(spec)
        return todo, other

    @staticmethod
    def other_configuration(spec: RunSpec) -> str | None:
        """The ``error:`` line (logged) when ``spec.run_dir`` holds a run that trained another
        configuration than ``spec`` asks for; None when it agrees or holds no saved config."""
        diffs = saved_config_differences(spec)
        if not diffs:
            return None
        line = (f"error: {spec.run_dir} holds a run of another configuration than the one asked for "
                f"({'; '.join(diffs[:4])}{f'; and {len(diffs) - 4} more' if len(diffs) > 4 else ''}): its results "
                f"are not this run's; move it aside (or use another --out) to run the one asked for")
        logger.error("%s", line)
        return line

    def run(self, spec: RunSpec) -> RunResult:
        """Run (or resume) one run; skip it when it has finished. Changes no file of the run directory
        unless the fit starts (module docstring)."""
        with stop_signals.installed():
            stop_signals.check()  # a stop signal arrived: no further run starts
            early = self._refusal(spec)
            if early is not None:
                return early
            stale = self._move_aside(spec)
            with tempfile.TemporaryDirectory(prefix="fedfdp-launch-") as tmp:
                result = self._launch(spec, Path(tmp), stale)
            stop_signals.check()  # the fit ended its round and checkpointed on the signal: stop here
            signum = stop_signals.stopped_fit(result.returncode, result.summary)
            if signum is not None:  # the signal went to the fit alone: resumable, not failed
                logger.warning("%s was stopped by %s after its round (sent to the fit, not to this harness)",
                               spec.run_dir, signal.Signals(signum).name)
                raise stop_signals.HarnessInterrupted(signum)
            return result

    def _launch(self, spec: RunSpec, tmp: Path, stale: Path | None) -> RunResult:
        """Launch the fit with its config and output staged in ``tmp``; commit them if it started."""
        config = self._config(spec, tmp)
        cmd = self.command(spec, config)
        logger.info("%s", " ".join(cmd))
        before = snapshot(spec.run_dir)
        output = StagedOutput(tmp / LOG_NAME, RunPaths(spec.run_dir).log, lambda: snapshot(spec.run_dir) != before)
        start = time.perf_counter()
        try:
            returncode = stop_signals.launch(cmd, stdout=output.stdout, stderr=subprocess.STDOUT,
                                             env=self._environment())
        finally:
            started = output.finish()
        wall = time.perf_counter() - start
        status: Literal["ran", "failed"] = "ran" if returncode == 0 else "failed"
        if not started:
            if stale is not None:
                _move_back(stale, spec.run_dir)
            kept = output.keep(spec.run_dir.name)
            logger.error("FAILED %s (exit %d): the fit did not start and nothing there was changed; its output: %s",
                         spec.run_dir, returncode, kept)
            return RunResult(spec, status, returncode, wall, read_summary(spec.run_dir), log_file=kept)
        if config != spec.config:  # the staged config takes its place now that the fit has started
            spec.config.write_text(config.read_text())
        recorded = [str(spec.config) if c == str(config) else c for c in cmd]
        RunPaths(spec.run_dir).harness.write_text(json.dumps({"command": recorded, "returncode": returncode,
                                                               "wall_seconds": wall}, indent=1))
        if status == "failed":
            logger.error("FAILED %s (exit %d, %.0f s): see %s", spec.run_dir, returncode, wall,
                         RunPaths(spec.run_dir).log)
        else:
            logger.info("done %s in %.0f s", spec.run_dir, wall)
        return RunResult(spec, status, returncode, wall, read_summary(spec.run_dir))

    def run_sweep(self, specs: Iterable[RunSpec]) -> list[RunResult]:
        """Fit the unfinished runs of ``specs`` together in this process (:mod:`fedfdp.sweep`).

        The rules of :meth:`run` (skipped, incomplete, busy, moved aside and back, staged config and
        output, ``harness.json`` once started), one result per spec in order. The runs must share
        an architecture and an algorithm the sweep can batch (else each fails with the sweep's one
        ``error:`` line, status 2). A run's log records (from its thread) are staged and appended
        to its ``fit.log`` once it has started. ``niceness`` and ``env`` apply to separate
        processes only: a sweep runs in this one. A stop signal ends every run's round (the sweep's
        own handling), then :class:`~fedfdp.experiments.stop_signals.HarnessInterrupted` is raised
        after the runs are committed, as :meth:`run` does: no further run or sweep starts.
        """
        from fedfdp.sweep import SweepRun, run_sweep

        specs = list(specs)
        results: dict[RunSpec, RunResult] = {}
        staged: list[tuple[RunSpec, SweepRun, Path, Path | None, Any]] = []
        # the sweep takes the stop signals while it runs (fedfdp.sweep: every run ends its round);
        # before and after it, stop_signals does, and a stopped sweep stops the harness as a stopped fit does
        with stop_signals.installed(), tempfile.TemporaryDirectory(prefix="fedfdp-sweep-") as tmp:
            stop_signals.check()
            for k, spec in enumerate(specs):
                early = self._refusal(spec)
                if early is not None:
                    results[spec] = early
                    continue
                stale = self._move_aside(spec)
                folder = Path(tmp) / str(k)
                folder.mkdir()
                config = self._config(spec, folder)
                cmd = self.command(spec, config)
                run = SweepRun(name=str(spec.run_dir), args=cmd[cmd.index("--config"):], log=folder / LOG_NAME)
                staged.append((spec, run, config, stale, snapshot(spec.run_dir)))
            if staged:
                run_sweep([run for _, run, _, _, _ in staged])
            for spec, run, config, stale, before in staged:
                results[spec] = self._commit(spec, run, config, stale, snapshot(spec.run_dir) != before)
            stopped = [r.returncode - 128 for r in results.values() if r.returncode - 128 in stop_signals.FORWARDED]
            if stopped:  # every run ended its round and checkpointed (or, stopped before it started, did not start)
                raise stop_signals.HarnessInterrupted(stopped[0])
            stop_signals.check()
        return [results[spec] for spec in specs]

    def _commit(self, spec: RunSpec, run: Any, config: Path, stale: Path | None, started: bool) -> RunResult:
        """A sweep's run ended: its config, log and ``harness.json`` into the run directory if it started."""
        code = 1 if run.status is None else int(run.status)
        status: Literal["ran", "failed"] = "ran" if code == 0 else "failed"
        text = run.log.read_text() if run.log is not None and run.log.is_file() else ""
        if not started:
            if stale is not None:
                _move_back(stale, spec.run_dir)
            kept = Path(tempfile.mkdtemp(prefix="fedfdp-refused-")) / f"{spec.run_dir.name}.{LOG_NAME}"
            kept.write_text(text)
            return RunResult(spec, status, code, run.seconds, read_summary(spec.run_dir), log_file=kept)
        if config != spec.config:
            spec.config.write_text(config.read_text())
        with open(RunPaths(spec.run_dir).log, "a") as log:
            log.write(text)
        args = [str(spec.config) if a == str(config) else a for a in run.args]
        RunPaths(spec.run_dir).harness.write_text(json.dumps({"command": ["sweep", *args], "returncode": code,
                                                               "wall_seconds": run.seconds}, indent=1))
        return RunResult(spec, status, code, run.seconds, read_summary(spec.run_dir))

    def _refusal(self, spec: RunSpec) -> RunResult | None:
        """The result of a run that is not launched: finished (skipped), ended with clients left out
        (incomplete), or its directory held by another process (failed); None to launch it."""
        summary = read_summary(spec.run_dir)
        if is_finished(summary):
            refusal = self.other_configuration(spec)  # (an unfinished one: the fit's resume check refuses it)
            if refusal is not None:
                return RunResult(spec, "failed", 2, refusal=refusal)
            logger.info("skip %s (finished)", spec.run_dir)
            return RunResult(spec, "skipped", wall_seconds=recorded_wall_seconds(spec.run_dir) or 0.0, summary=summary)
        if ended_with_missing_clients(summary):
            missing = summary.get("missing_clients") or {}
            left = "; ".join(f"client {c}: {rounds_phrase(r)}" for c, r in missing.items())
            logger.error("error: %s ran every round but left clients out (status %s; %s): not a complete run, "
                         "and a resume cannot add them; move it aside to run it afresh", spec.run_dir,
                         summary.get("status"), left or "the final evaluation missed clients")
            return RunResult(spec, "incomplete", summary=summary)
        try:
            RunLock.check_free(spec.run_dir)
        except ConfigError as err:
            logger.error("error: %s", err)
            return RunResult(spec, "failed", 2, summary=summary, refusal=f"error: {err}")
        return None

    @staticmethod
    def _move_aside(spec: RunSpec) -> Path | None:
        """Move a run that stopped before its first checkpoint aside (``.stale-<time>``); its new path."""
        if resumable(spec.run_dir) or not run_files(spec.run_dir):
            return None
        stale = spec.run_dir.with_name(f"{spec.run_dir.name}.stale-{int(time.time())}")
        spec.run_dir.rename(stale)
        logger.warning("%s stopped before its first checkpoint: moved to %s, starting it again", spec.run_dir, stale)
        return stale

    @staticmethod
    def _config(spec: RunSpec, tmp: Path) -> Path:
        """The config file the fit reads: ``spec.config``, made first when the spec makes it; a made config
        for a file inside the run directory that differs from it is staged in ``tmp`` instead."""
        if spec.make_config is None:
            return spec.config
        text = yaml.safe_dump(dict(spec.make_config()), sort_keys=False)
        if not spec.config.resolve().is_relative_to(spec.run_dir.resolve()):
            spec.config.parent.mkdir(parents=True, exist_ok=True)
            spec.config.write_text(text)
            return spec.config
        if spec.config.is_file() and spec.config.read_text() == text:
            return spec.config
        staged = tmp / spec.config.name
        staged.write_text(text)
        return staged

    def run_all(self, specs: Iterable[RunSpec], *, jobs: int = 1) -> Iterator[RunResult]:
        """:meth:`run` every spec, ``jobs`` at a time; yields the results in the order of ``specs``.

        Stopping the iteration early starts no further run (runs already started are waited for).
        """
        specs = list(specs)
        with stop_signals.installed():  # in the main thread: the workers' fits get the stop signals
            if jobs <= 1:
                for spec in specs:
                    yield self.run(spec)
                return
            pool = ThreadPoolExecutor(max_workers=jobs)
            try:
                futures = [pool.submit(self.run, spec) for spec in specs]
                for future in futures:
                    yield future.result()
            finally:
                pool.shutdown(wait=True, cancel_futures=True)

    def _environment(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        for key, value in self.env_defaults.items():
            env.setdefault(key, value)
        return env


def _move_back(stale: Path, run_dir: Path) -> None:
    """Put a run that was moved aside back in ``run_dir`` (the fit refused to start over it)."""
    try:
        if run_dir.is_dir():
            run_dir.rmdir()  # only if empty: the fit removes a directory it created and left empty
        stale.rename(run_dir)
        logger.warning("moved %s back to %s", stale, run_dir)
    except OSError as err:
        logger.error("error: could not move %s back to %s (%s)", stale, run_dir, err.strerror or err)
