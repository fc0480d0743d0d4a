"""The one experiment runner: launch ``fedfdp.fit`` runs, skip finished ones, resume interrupted ones.

Every experiment command (``finp-table``, ``rcdpfl-table``, ``paper-table*``, ``tune``) plans its
runs as :class:`RunSpec` values and hands them to a :class:`Runner`, which for each run

* skips it when its ``summary.json`` says it finished (:func:`fedfdp.experiments.results.is_finished`:
  status ``completed`` or ``budget_spent``);
* resumes it with ``--ckpt_path last`` when it has ``checkpoints/last.ckpt``;
* moves a run that left results but no checkpoint (stopped before its first checkpoint) aside
  to ``<run_dir>.stale-<unix time>`` and starts it again (``fedfdp.fit`` refuses to start over
  results);
* otherwise starts it: writes its config when the spec makes one (:attr:`RunSpec.make_config`),
  then runs one subprocess ``[nice -n N] python -m fedfdp.fit --config C --run_dir D
  [--seed_everything K] ARGS [--ckpt_path last]`` with its output appended to
  ``<run_dir>/fit.log``, and writes the command, exit status and wall time to
  ``<run_dir>/harness.json``.

Reading the results back and tabulating them is :mod:`fedfdp.experiments.results`.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from fedfdp.experiments.results import is_finished, read_summary
from fedfdp.rundir import run_files

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
        make_config: when given, its result is written as YAML to ``config`` just before the
            run starts (not for a finished run, nor for a dry run).
    """

    run_dir: Path
    config: Path
    seed: int | None = None
    args: tuple[str, ...] = ()
    make_config: Callable[[], Mapping[str, Any]] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class RunResult:
    """What became of one run: ``skipped`` (already finished), ``ran`` (exit 0) or ``failed``."""

    spec: RunSpec
    status: Literal["skipped", "ran", "failed"]
    returncode: int = 0
    wall_seconds: float = 0.0
    summary: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        """Whether the run has finished (skipped as such, or ran to its end)."""
        return is_finished(self.summary)

    @property
    def log(self) -> Path:
        """The run's ``fit.log``."""
        return self.spec.run_dir / "fit.log"


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
    return (run_dir / "checkpoints" / "last.ckpt").exists()


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

    def command(self, spec: RunSpec) -> list[str]:
        """The command line of ``spec`` as it would run now (resuming when it has a checkpoint)."""
        cmd = ["nice", "-n", str(self.niceness)] if self.niceness else []
        cmd += [sys.executable, "-m", "fedfdp.fit", "--config", str(spec.config), "--run_dir", str(spec.run_dir)]
        if spec.seed is not None:
            cmd += ["--seed_everything", str(spec.seed)]
        cmd += list(spec.args)
        if resumable(spec.run_dir):
            cmd += ["--ckpt_path", "last"]
        return cmd

    def pending(self, specs: Iterable[RunSpec]) -> list[RunSpec]:
        """The runs of ``specs`` that have not finished."""
        return [spec for spec in specs if not is_finished(read_summary(spec.run_dir))]

    def run(self, spec: RunSpec) -> RunResult:
        """Run (or resume) one run; skip it when it has finished."""
        summary = read_summary(spec.run_dir)
        if is_finished(summary):
            logger.info("skip %s (finished)", spec.run_dir)
            return RunResult(spec, "skipped", summary=summary)
        self._prepare(spec)
        cmd = self.command(spec)
        logger.info("%s", " ".join(cmd))
        start = time.perf_counter()
        with open(spec.run_dir / "fit.log", "a") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=self._environment())
        wall = time.perf_counter() - start
        (spec.run_dir / "harness.json").write_text(json.dumps({"command": cmd, "returncode": proc.returncode,
                                                               "wall_seconds": wall}, indent=1))
        status: Literal["ran", "failed"] = "ran" if proc.returncode == 0 else "failed"
        if status == "failed":
            logger.error("FAILED %s (exit %d, %.0f s): see %s", spec.run_dir, proc.returncode, wall,
                         spec.run_dir / "fit.log")
        else:
            logger.info("done %s in %.0f s", spec.run_dir, wall)
        return RunResult(spec, status, proc.returncode, wall, read_summary(spec.run_dir))

    def run_all(self, specs: Iterable[RunSpec], *, jobs: int = 1) -> Iterator[RunResult]:
        """:meth:`run` every spec, ``jobs`` at a time; yields the results in the order of ``specs``.

        Stopping the iteration early starts no further run (runs already started are waited for).
        """
        specs = list(specs)
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

    def run_sweep(self, specs: Iterable[RunSpec]) -> list[RunResult]:
        """Fit the unfinished runs of ``specs`` together in this process (:mod:`fedfdp.sweep`).

        The same rules as :meth:`run`: a finished run is skipped, one with a checkpoint resumes,
        one stopped before its first checkpoint is moved aside and started again; its config is
        written first. The runs must share an architecture and an algorithm the sweep can batch
        (else every run fails with the sweep's one ``error:`` line). Each run's log is its
        ``fit.log``, its command and status its ``harness.json``. ``niceness`` and ``env`` apply to
        a separate process only: a sweep runs in this one.
        """
        from fedfdp.sweep import SweepRun, run_sweep

        specs = list(specs)
        results: dict[RunSpec, RunResult] = {}
        pending: list[tuple[RunSpec, SweepRun]] = []
        for spec in specs:
            summary = read_summary(spec.run_dir)
            if is_finished(summary):
                results[spec] = RunResult(spec, "skipped", summary=summary)
                continue
            self._prepare(spec)
            args = self.command(spec)[self.command(spec).index("--config"):]
            pending.append((spec, SweepRun(name=str(spec.run_dir), args=args, log=spec.run_dir / "fit.log")))
        if pending:
            run_sweep([run for _, run in pending])
        for spec, run in pending:
            code = 1 if run.status is None else int(run.status)
            (spec.run_dir / "harness.json").write_text(json.dumps(
                {"command": ["sweep", *run.args], "returncode": code, "wall_seconds": run.seconds}, indent=1))
            status: Literal["ran", "failed"] = "ran" if code == 0 else "failed"
            results[spec] = RunResult(spec, status, code, run.seconds, read_summary(spec.run_dir))
        return [results[spec] for spec in specs if spec in results]

    def _prepare(self, spec: RunSpec) -> None:
        """Move a run stopped before its first checkpoint aside; create the directory; write its config."""
        if not resumable(spec.run_dir) and run_files(spec.run_dir):
            stale = spec.run_dir.with_name(f"{spec.run_dir.name}.stale-{int(time.time())}")
            spec.run_dir.rename(stale)
            logger.warning("%s stopped before its first checkpoint: moved to %s, starting it again", spec.run_dir,
                           stale)
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        if spec.make_config is not None:
            spec.config.parent.mkdir(parents=True, exist_ok=True)
            spec.config.write_text(yaml.safe_dump(dict(spec.make_config()), sort_keys=False))

    def _environment(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        for key, value in self.env_defaults.items():
            env.setdefault(key, value)
        return env
