"""Many runs of one config in one process (``python -m fedfdp.experiments sweep``).

::

    python -m fedfdp.experiments sweep --config CONFIG --seeds 0 1 2 [--grid FILE] --out DIR
        [--ckpt_path last] [--dry-run] [--fit-args ...]

Every run is ``fedfdp.fit --config CONFIG --run_dir DIR/<name> --seed_everything <s>`` plus its
grid point's values as dotted overrides; all of them are trained together by :mod:`fedfdp.sweep`
(one batched per-sample pass per round for every client of every run), and each writes the files
``fedfdp.fit`` writes, in ``DIR/<name>/``. ``<name>`` is ``seed<s>`` when only seeds vary, else
``<key>=<value>,...,seed<s>`` with each key's last component.

**Grid** (``--grid FILE``, YAML): a mapping from dotted config keys to lists of values (every
combination), or a list of such mappings with single values (exactly those points), e.g.::

    model.algorithm.init_args.lr: [0.5, 1.0, 2.0]
    model.algorithm.init_args.privacy.init_args.max_grad_norm: [0.1, 0.3]

**Resume.** ``--ckpt_path last`` continues an interrupted sweep: a run whose ``summary.json`` says
it finished is skipped, a run with ``checkpoints/last.ckpt`` resumes from it, the others start.
Without it, a run directory that holds a run is refused, as ``fedfdp.fit`` refuses it.

W&B is off unless ``--fit-args --wandb offline`` (one process holds every run). The sweep writes
``DIR/sweep.json``: each run's name, arguments, exit status and wall time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
from pathlib import Path
from typing import Any

import yaml

from fedfdp import strict_yaml
from fedfdp.experiments._common import add_dry_run, add_list_option, message, output, print_command
from fedfdp.experiments.results import is_finished, read_summary
from fedfdp.rundir import RunPaths

logger = logging.getLogger(__name__)

__all__ = ["grid_points", "plan_sweep", "register"]


def grid_points(path: str | None) -> list[dict[str, Any]]:
    """The grid's points (``[{}]`` without a grid); one ``error:``-ready ValueError for a bad file."""
    if path is None:
        return [{}]
    try:
        grid = strict_yaml.load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"--grid {path}: cannot read it ({str(err).splitlines()[0]})") from err
    if isinstance(grid, dict) and grid and all(isinstance(k, str) for k in grid):
        lists = {k: (v if isinstance(v, list) else [v]) for k, v in grid.items()}
        if any(not v for v in lists.values()):
            raise ValueError(f"--grid {path}: every key needs at least one value")
        keys = list(lists)
        return [dict(zip(keys, combo)) for combo in itertools.product(*(lists[k] for k in keys))]
    if isinstance(grid, list) and grid and all(isinstance(p, dict) and p for p in grid):
        return [dict(p) for p in grid]
    raise ValueError(f"--grid {path}: must be a mapping of dotted keys to lists of values, or a non-empty list of "
                     f"mappings (one per point)")


def _value(value: Any) -> str:
    """A value as the ``fedfdp.fit`` command line takes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def run_name(point: dict[str, Any], seed: int) -> str:
    """``seed<s>``, prefixed by ``<key>=<value>,`` for each grid key (its last dotted component)."""
    parts = [f"{key.rsplit('.', 1)[-1]}={_value(value)}".replace("/", "_") for key, value in point.items()]
    return ",".join([*parts, f"seed{seed}"])


def plan_sweep(config: str, seeds: list[int], points: list[dict[str, Any]], out: Path,
               fit_args: list[str], resume: bool) -> tuple[list[Any], list[str]]:
    """``(runs to fit, names of runs already finished)``; each run's ``fedfdp.fit`` arguments."""
    from fedfdp.sweep import SweepRun

    runs, finished = [], []
    for point in points:
        for seed in seeds:
            name = run_name(point, seed)
            run_dir = out / name
            if resume and is_finished(read_summary(run_dir)):
                finished.append(name)
                continue
            args = ["--config", config, "--run_dir", str(run_dir), "--seed_everything", str(seed)]
            for key, value in point.items():
                args += [f"--{key}", _value(value)]
            args += ["--wandb", "disabled", "--trainer.enable_progress_bar", "false", *fit_args]
            if resume and RunPaths(run_dir).last_checkpoint.exists():
                args += ["--ckpt_path", "last"]
            runs.append(SweepRun(name=name, args=args))
    return runs, finished


def run(args: argparse.Namespace) -> int:
    """Plan and fit the sweep; its exit status (0: every run ended with 0)."""
    try:
        points = grid_points(args.grid)
    except ValueError as err:
        message(f"error: {err}")
        return 2
    if not Path(args.config).is_file():
        message(f"error: --config {args.config}: no such file")
        return 2
    out = Path(args.out)
    runs, finished = plan_sweep(args.config, args.seeds, points, out, args.fit_args or [], args.ckpt_path == "last")
    if args.dry_run:
        for r in runs:
            print_command(["python", "-m", "fedfdp.fit", *r.args])
        return 0
    if finished:
        logger.info("sweep: %d runs finished before, skipped: %s", len(finished), ", ".join(finished))
    if not runs:
        output(f"sweep {out}: all {len(finished)} runs had finished")
        return 0
    from fedfdp.sweep import run_sweep

    status = run_sweep(runs)
    out.mkdir(parents=True, exist_ok=True)
    index = [{"name": r.name, "args": r.args, "status": r.status, "wall_seconds": round(r.seconds, 2)} for r in runs]
    path = out / "sweep.json"
    previous = json.loads(path.read_text()) if path.is_file() else []
    kept = [entry for entry in previous if entry.get("name") not in {r.name for r in runs}]
    path.write_text(json.dumps(kept + index, indent=1))
    done = sum(r.status == 0 for r in runs)
    output(f"sweep {out}: {done} of {len(runs)} runs ended with status 0 (see {path})")
    return status


def register(subparsers: Any) -> None:
    """Add ``sweep``."""
    p = subparsers.add_parser("sweep", help="train many runs of one config (seeds x a grid) in one process")
    p.set_defaults(func=run)
    p.add_argument("--config", required=True, help="the runs' fedfdp.fit config")
    add_list_option(p, "--seeds", item_type=int, default=[0], help="seeds (--seed_everything)")
    p.add_argument("--grid", default=None, help="YAML grid of dotted keys to values (module docstring)")
    p.add_argument("--out", required=True, help="output folder: one run directory per run")
    p.add_argument("--ckpt_path", "--ckpt-path", dest="ckpt_path", choices=["last"], default=None,
                   help="'last': continue an interrupted sweep (finished runs skipped, others resumed)")
    add_dry_run(p)
    p.add_argument("--fit-args", nargs=argparse.REMAINDER, default=None,
                   help="extra arguments passed to every run (last option)")
