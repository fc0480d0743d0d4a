"""Hyper-parameter tuning on held-out validation data (``python -m fedfdp.experiments tune``), with Optuna.

::

    python -m fedfdp.experiments tune --config configs/fmnist.yaml --trials 30 [--study-dir DIR]
        [--seeds 0] [--val-fraction 0.1] [--objective val_accuracy] [--last 5] [--rounds R]
        [--space SPACE.yaml] [--sampler tpe|grid] [--jobs N | --batch R] [--startup-trials N] [--wandb MODE]
        [--dry-run]

**Validation data only.** Every trial trains with ``--data.init_args.val_fraction V`` (default
0.1): that fraction of each client's *training* split is held out (seeded by the partition seed;
the partition and the test splits are those of an untuned run) and the federation's evaluations
also report ``val_accuracy``, ``val_accuracy_worst``, ``val_psi``, ... The objective is read from
the run's ``summary.json``: the mean over the last ``--last`` (5) evaluations of a validation
metric or a weighted sum of them (``--objective "val_accuracy+val_accuracy_worst"``,
``"val_accuracy-10*val_psi"``), maximised. Only ``val_*`` metrics are accepted; the test metrics
that every run also records are never read.

**Trials.** Trial ``k`` is one ``python -m fedfdp.fit`` subprocess with run directory
``<study-dir>/trial<k>/`` (``trial<k>/seed<s>/`` per seed when ``--seeds`` lists several; the
objective is then the mean over the seeds): the base config plus the trial's values as dotted
command-line overrides (``harness.json`` in the run directory holds the command, ``fit.log`` its
output; the trial runner is :mod:`fedfdp.experiments.trials`). It logs to W&B like any run, in
the group ``--study-name`` (default: the study directory's name). Trial 0 of a new study starts from the config's own values where they lie in
the search space, so the chosen configuration is never worse on validation than the config.

**Search space** (``--space FILE``, YAML or JSON; the default, :data:`DEFAULT_SPACE`, suits the
DP-SGD configs such as ``configs/fmnist.yaml`` and ``configs/fmnist_dpfedavg.yaml``): a mapping
from dotted config keys (as on the ``fedfdp.fit`` command line) to a distribution
``{type: float, low, high, log: true}``, ``{type: int, low, high}``, ``{type: categorical,
choices: [...]}``, or a fixed value. ``choices`` may also be a mapping of named alternatives whose
values hold further distributions (the server optimizer: SGD with a momentum, or Adam with its
lr), and the exponential moving average of the global weights (``model.ema_decay``; null: none).
The study writes the space it uses to ``<study-dir>/search_space.yaml``. The space's format and
checks live in :mod:`fedfdp.experiments.search_space`.

**Sampler.** ``--sampler tpe`` (default): Optuna's TPE, trial 0 at the config's own values.
``--sampler grid``: every combination of an all-categorical space once, in a seeded random order
(Optuna's GridSampler; the study stops when the grid is done), also across interrupted and resumed
sessions (:mod:`fedfdp.experiments.grid_sampler`): for a few expensive full-length trials, where
TPE would spend some of them on points it has already run.

**Parallel trials.** ``--jobs N`` runs up to N trials at a time, each its own ``fedfdp.fit``
process (give each a share of the cores, e.g. ``OMP_NUM_THREADS``, or one GPU to several). The
trials are still asked in trial order from one process, so the values they draw do not depend on
N while TPE draws at random: its first 10 trials (Optuna's ``n_startup_trials``) draw from its
seeded random stream without looking at results. After those, a trial asked while others run does
not see their results; ``--jobs 1`` (the default) keeps the purely sequential study.

**Trials in one process.** ``--batch R`` asks R trials at a time (in trial order) and fits all of
them (every seed of each) together in this process with the sweep engine (:mod:`fedfdp.sweep`:
one batched per-sample pass per round for every client of every trial); each trial is still its
own run directory and its result that of the trial alone. As with ``--jobs``, the R trials of a
batch do not see each other's results. ``--startup-trials N`` sets how many random trials TPE
draws before it models the results (Optuna's ``n_startup_trials``, default 10): a study of 64
trials spends most of them past its start-up.

**Rounds.** Without ``--rounds`` every trial runs the config's rounds: for the DP configs
(``num_rounds: null``) as many as the privacy budget allows for the trial's sample rate and local
steps (``callbacks.RDPAccounting`` plans them). ``--rounds R`` caps every trial at R rounds: a
shortened study for quick iteration, which the output says.

**Resume.** The study lives in ``<study-dir>/study.db`` (SQLite); ``--trials N`` is the number of
finished trials the study should hold, so running the command again (with a larger N) continues
it: finished trials are kept and not re-run. A trial interrupted while running (Ctrl-C, a killed
job) is finished first, in its own run directory, from its last checkpoint (``--ckpt_path
last``; from the start when it had saved none), with the same values. A trial whose run fails
(a diverging learning rate, say) counts as finished and failed (Optuna state FAIL, the reason in
its ``error`` attribute and ``fit.log``) and is not re-run; when the first trials of a study fail
before any has finished, the command stops with the error instead (a broken config or search
space would fail every trial). A study is tied to its
settings (the config's content, validation fraction, objective, rounds, seeds, search space):
resuming it with others is refused. The config's path is not part of it: a study folder copied to
another checkout (its ``study.db`` is enough) continues there. A ``study.db`` that cannot be read
(truncated, junk, another study's) or a folder in place of one of the study's files is refused in
one line before anything is written (``tests/experiments/test_study_file_faults.py`` breaks each
file every way).

**Stopping.** SIGINT or SIGTERM (Ctrl-C, ``kill``, a scheduler; to the tune process alone or to
its process group) is passed on to the running trials' fits (:mod:`fedfdp.experiments.stop_signals`;
with ``--batch``, the sweep's own handling): each ends its round and checkpoints, the trials stay
RUNNING in the study (they are not recorded as failed), no further trial is asked for, and the
command exits ``128 + signal`` with one ``error:`` line; the same command finishes those trials
first. No round is cut, so none of a trial's releases is made twice. A signal sent to one trial's
fit alone stops the study the same way (the fit is resumable, not failed).

**Result.** ``<study-dir>/best.yaml`` is the base config with the best trial's values (and the
same ``val_fraction``, so the final model trains on the same data it was tuned on; the base
config's rounds, not the ``--rounds`` cap), ``best.json`` the trial, its value and the command
that trains it and reports its test metrics: test numbers are reported only for the chosen
configuration, from that run. Tuning itself is not charged to ε (as in the paper and most of the
literature): ε covers one training run.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from fedfdp import strict_yaml
from fedfdp.cli.errors import config_file_problem
from fedfdp.experiments._common import add_dry_run, add_list_option, message, output, print_command
from fedfdp.experiments import stop_signals
from fedfdp.experiments.grid_sampler import grid_sampler, grid_trials_to_ask
from fedfdp.experiments.study_folder import open_study
from fedfdp.experiments.search_space import (
    DEFAULT_SPACE, DEFAULT_SPACE_YAML, VAL_KEY, TuneError, apply_overrides, baseline_params, grid_size, grid_space,
    load_space, sample_overrides,
)
from fedfdp.experiments.trials import (
    Settings, fit_command, objective_value, parse_objective, run_trial, run_trials_together, write_trials,
)

__all__ = ["TuneError", "objective_value", "parse_objective", "register", "run"]

logger = logging.getLogger(__name__)

# ---- the command ---------------------------------------------------------------------------------
def _settings(args: argparse.Namespace) -> Settings:
    """Check the arguments (TuneError with one line) and gather them."""
    problem = config_file_problem(args.config)
    if problem is not None:
        raise TuneError(problem)
    if args.trials < 1:
        raise TuneError(f"--trials must be >= 1, got {args.trials}")
    if not 0 < args.val_fraction < 1:
        raise TuneError(f"--val-fraction must be in (0, 1): trials score on data held out of the training "
                        f"splits, got {args.val_fraction}")
    if args.jobs < 1:
        raise TuneError(f"--jobs must be >= 1, got {args.jobs}")
    if args.batch < 1 or (args.batch > 1 and args.jobs > 1):
        raise TuneError(f"--batch must be >= 1, and --batch > 1 runs its trials in this process: use it with --jobs "
                        f"1, got --batch {args.batch} --jobs {args.jobs}")
    if args.startup_trials < 0:
        raise TuneError(f"--startup-trials must be >= 0, got {args.startup_trials}")
    if args.last < 1:
        raise TuneError(f"--last must be >= 1, got {args.last}")
    if args.rounds is not None and args.rounds < 1:
        raise TuneError(f"--rounds must be >= 1, got {args.rounds}")
    if any(s < 0 for s in args.seeds):
        raise TuneError(f"--seeds must be >= 0, got {' '.join(map(str, args.seeds))}")
    terms = parse_objective(args.objective)
    space = load_space(args.space)
    if args.sampler == "grid":
        grid_space(space)  # every distribution categorical (TuneError naming the key otherwise)
    config = Path(args.config)
    study_dir = Path(args.study_dir) if args.study_dir else Path("runs") / "tune" / config.stem
    if study_dir.exists() and not study_dir.is_dir():
        raise TuneError(f"--study-dir {study_dir} is a file")
    name = args.study_name or study_dir.resolve().name
    return Settings(config=config, study_dir=study_dir, study_name=name, val_fraction=float(args.val_fraction),
                    objective=args.objective, terms=terms, last=args.last, rounds=args.rounds,
                    seeds=list(dict.fromkeys(args.seeds)), space=space, wandb=args.wandb,
                    fit_args=list(args.fit_args or []), sampler=args.sampler)


def _sampler(kind: str, space: dict[str, Any], seed: int, trials_so_far: int, startup_trials: int = 10,
             taken: Sequence[Any] = ()) -> Any:
    """The study's sampler; ``taken``: trials of another storage whose grid points are held (a dry run)."""
    import optuna

    # a fresh seed per session: a resumed study must not draw its first trials' values again
    if kind == "grid":
        return grid_sampler(space, seed + trials_so_far, taken)
    return optuna.samplers.TPESampler(seed=seed + trials_so_far, n_startup_trials=startup_trials)


def _dry_run(settings: Settings, n_trials: int, sampler_seed: int) -> int:
    """Print the commands of the trials that would run; run and write nothing."""
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    db = settings.study_dir / "study.db"
    existing: list[Any] = []
    if db.exists():
        storage = f"sqlite:///file:{db.resolve()}?mode=ro&uri=true"
        try:
            existing = optuna.load_study(study_name=settings.study_name, storage=storage).trials
        except Exception as err:  # noqa: BLE001 - any storage problem: say so in one line
            raise TuneError(f"cannot read the study {settings.study_name!r} in {db}: {' '.join(str(err).split())}") \
                from err
    stale = [t for t in existing if t.state == TrialState.RUNNING and "overrides" in t.user_attrs]
    done = sum(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in existing)
    for t in stale:
        for seed in settings.seeds:
            print_command(fit_command(settings, settings.run_dir(t.number, seed), seed, t.user_attrs["overrides"]))
    todo = max(n_trials - done - len(stale), 0)
    if settings.sampler == "grid":
        todo = grid_trials_to_ask(settings.space, existing, n_trials)
    study = optuna.create_study(direction="maximize",
                                sampler=_sampler(settings.sampler, settings.space, sampler_seed, len(existing),
                                                 taken=existing))
    if not existing and settings.sampler == "tpe":
        base = baseline_params(strict_yaml.load(settings.config.read_text()), settings.space)
        if base:
            study.enqueue_trial(base)
    for k in range(todo):
        trial = study.ask()
        overrides = sample_overrides(trial, settings.space)
        for seed in settings.seeds:
            print_command(fit_command(settings, settings.run_dir(len(existing) + k, seed), seed, overrides))
    if todo > 1:
        message("# dry run: the values of later trials depend on the results of earlier ones; these are "
                "drawn without results")
    return 0


def write_best(settings: Settings, study: Any) -> dict[str, Any] | None:
    """``best.yaml`` (base config + best values + val_fraction) and ``best.json``; None without a finished trial."""
    from optuna.trial import TrialState

    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    if not complete:
        return None
    best = study.best_trial
    overrides = dict(best.user_attrs["overrides"])
    config = strict_yaml.load(settings.config.read_text())
    config = apply_overrides(config, {**overrides, VAL_KEY: settings.val_fraction})
    path = settings.study_dir / "best.yaml"
    header = (f"# Chosen by `python -m fedfdp.experiments tune` (study {settings.study_name!r}, trial {best.number} of "
              f"{len(complete)} finished): {settings.config} with the trial's values.\n"
              f"# Objective ({settings.objective}, mean of the last {settings.last} evaluations, validation split "
              f"data.init_args.val_fraction = {settings.val_fraction}): {best.value:.6g}.\n"
              + (f"# The trials were shortened to {settings.rounds} rounds (--rounds); this config keeps the "
                 f"config's own rounds.\n" if settings.rounds is not None else ""))
    path.write_text(header + yaml.safe_dump(config, sort_keys=False))
    commands = []
    for seed in settings.seeds:
        run_dir = settings.study_dir / "best" if len(settings.seeds) == 1 else settings.study_dir / "best" / f"seed{seed}"
        cmd = ["python", "-m", "fedfdp.fit", "--config", str(path), "--run_dir", str(run_dir),
               "--seed_everything", str(seed), "--wandb_group", settings.study_name]
        commands.append(cmd)
    info = {"study": settings.study_name, "trial": best.number, "value": best.value, "objective": settings.objective,
            "last": settings.last, "val_fraction": settings.val_fraction, "params": best.params,
            "overrides": overrides, "run_dirs": best.user_attrs.get("run_dirs"), "trials_finished": len(complete),
            "trials_failed": sum(t.state == TrialState.FAIL for t in study.trials),
            "shortened_rounds": settings.rounds, "config": str(path), "commands": commands}
    (settings.study_dir / "best.json").write_text(json.dumps(info, indent=2, default=str))
    return info


def run(args: argparse.Namespace) -> int:
    """Run (or continue) the study until it holds ``--trials`` finished trials; write the best config."""
    try:
        settings = _settings(args)
        if args.dry_run:
            return _dry_run(settings, args.trials, args.sampler_seed)
        return _run_study(settings, args.trials, args.sampler_seed, args.jobs, args.batch, args.startup_trials)
    except TuneError as err:
        message(f"error: tune: {err}")
        return 2


def _run_study(settings: Settings, n_trials: int, sampler_seed: int, jobs: int = 1, batch: int = 1,
               startup_trials: int = 10) -> int:
    import optuna
    from optuna.trial import TrialState

    study, storage = open_study(settings)
    study = optuna.load_study(study_name=settings.study_name, storage=storage,
                              sampler=_sampler(settings.sampler, settings.space, sampler_seed, len(study.trials),
                                               startup_trials))
    (settings.study_dir / "search_space.yaml").write_text(
        (DEFAULT_SPACE_YAML if settings.space == DEFAULT_SPACE else yaml.safe_dump(settings.space, sort_keys=False)))
    if not study.trials and settings.sampler == "tpe":
        base = baseline_params(strict_yaml.load(settings.config.read_text()), settings.space)
        if base:
            study.enqueue_trial(base, user_attrs={"baseline": True})
    if settings.sampler == "grid" and n_trials > grid_size(settings.space):
        logger.info("the grid has %d points: the study stops there, not at --trials %d", grid_size(settings.space),
                    n_trials)
        n_trials = grid_size(settings.space)
    shortened = f" (shortened study: every trial capped at {settings.rounds} rounds)" if settings.rounds else ""
    logger.info("study %s in %s: %d finished trials, %d wanted%s", settings.study_name, settings.study_dir,
                sum(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in study.trials), n_trials, shortened)

    def record(trial: optuna.trial.Trial, result: tuple[float | None, dict[str, Any]]) -> None:
        """Tell the study how a trial ended (in the main thread: the storage is never written concurrently)."""
        nonlocal finished
        finished += 1
        outstanding.discard(trial.number)
        value, notes = result
        number = trial.number
        for key, note in notes.items():
            trial.set_user_attr(key, note)
        if value is None:
            study.tell(number, state=TrialState.FAIL)
            logger.error("trial %d failed: %s", number, notes.get("error"))
            if not any(t.state == TrialState.COMPLETE for t in study.trials):
                raise TuneError(f"trial {number} failed and the study has no finished trial, so the setup itself "
                                f"looks broken: {notes.get('error')}")
        else:
            study.tell(number, value)
            logger.info("trial %d: %s = %.6g", number, settings.objective, value)
        write_trials(settings, study)  # trials.txt, the study's plain-text record

    # interrupted trials first, in their own run directories, with their own values
    queue: list[tuple[optuna.trial.Trial, dict[str, Any]]] = []
    for t in study.trials:
        if t.state == TrialState.RUNNING:
            if "overrides" not in t.user_attrs:
                study.tell(t.number, state=TrialState.FAIL)
                continue
            logger.info("trial %d was interrupted: finishing it from its last checkpoint", t.number)
            # the running trial of the interrupted session, as a Trial of this one (Optuna has no public lookup)
            queue.append((optuna.trial.Trial(study, t._trial_id), dict(t.user_attrs["overrides"])))  # noqa: SLF001
    finished = sum(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in study.trials)
    if settings.sampler == "grid":  # the trials that run: the interrupted ones, then one per point left
        n_trials = finished + len(queue) + grid_trials_to_ask(settings.space, study.trials, n_trials)
    outstanding: set[int] = set()  # the trials handed out and not recorded yet

    def next_trial() -> tuple[optuna.trial.Trial, dict[str, Any]] | None:
        if queue:
            item = queue.pop(0)
        elif finished + len(outstanding) >= n_trials:
            return None
        else:
            trial = study.ask()  # asked in trial order, in this thread (see --jobs)
            overrides = sample_overrides(trial, settings.space)
            trial.set_user_attr("overrides", overrides)
            item = (trial, overrides)
        outstanding.add(item[0].number)
        return item

    with stop_signals.installed():  # in the main thread: a stop signal reaches the trials' fits (Stopping)
        while batch > 1 and (items := _take(next_trial, min(batch, max(n_trials - finished, len(queue))))):
            # --batch R: R trials (every seed of each) fitted together in this process, one batched pass
            # per round (fedfdp.sweep); recorded in trial order once all of them have ended. Stopped, the
            # sweep raises HarnessInterrupted and its trials stay RUNNING: the next invocation finishes them.
            results = run_trials_together(settings, [(trial.number, overrides) for trial, overrides in items])
            for (trial, _), result in zip(items, results):
                record(trial, result)
        # Each trial is a fedfdp.fit subprocess (run_trial); the pool's threads only wait for them. Not
        # Runner.run_all: it takes a fixed list, while a study asks each new trial when a slot frees.
        stop_signals.run_in_pool(jobs, next_trial, lambda item: run_trial(settings, item[0].number, item[1]),
                                 lambda item, result: record(item[0], result))
    info = write_best(settings, study)
    if info is None:
        message(f"error: tune: no trial of the study in {settings.study_dir} finished; see the trials' fit.log")
        return 1
    output(f"study {settings.study_name}: {info['trials_finished']} finished trials, {info['trials_failed']} failed"
           f"{shortened}")
    output(f"best: trial {info['trial']} ({info['run_dirs'][0] if info['run_dirs'] else ''}), {settings.objective} "
           f"(validation, mean of the last {settings.last} evaluations) = {info['value']:.6g}")
    output(f"params: {json.dumps(info['params'])}")
    output(f"wrote {settings.study_dir / 'best.yaml'} and best.json; train the chosen configuration and report its "
           f"test metrics (summary.json: accuracy, accuracy_worst, psi) with:")
    for cmd in info["commands"]:
        print_command(cmd)
    if settings.rounds:
        output(f"note: a shortened study: trials ran at most {settings.rounds} rounds; best.yaml keeps the config's "
               f"rounds")
    output("note: tuning is not charged to the privacy budget; ε covers one training run")
    return 0


def _take(ask: Any, count: int) -> list[Any]:
    """Up to ``count`` items from ``ask()`` (stopping at the first None)."""
    items = []
    while len(items) < count and (item := ask()) is not None:
        items.append(item)
    return items


def register(subparsers: Any) -> None:
    """Add the ``tune`` command."""
    p = subparsers.add_parser("tune", help="tune hyper-parameters with Optuna on validation data held out of "
                                           "each client's training split",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="base fedfdp.fit config (e.g. configs/fmnist.yaml)")
    p.add_argument("--trials", type=int, required=True,
                   help="finished trials the study should hold (a resumed study runs only the missing ones)")
    p.add_argument("--study-dir", "--study_dir", dest="study_dir", default=None,
                   help="study folder: study.db, trial<k>/ run directories, best.yaml (default: runs/tune/<config "
                        "name>)")
    p.add_argument("--study-name", "--study_name", dest="study_name", default=None,
                   help="Optuna study name and W&B group (default: the study folder's name)")
    add_list_option(p, "--seeds", item_type=int, default=[0], help="seeds every trial runs (objective: their mean)")
    p.add_argument("--val-fraction", "--val_fraction", dest="val_fraction", type=float, default=0.1,
                   help="fraction of each client's training split held out for validation (default: 0.1)")
    p.add_argument("--objective", default="val_accuracy",
                   help="validation metric to maximise, or a weighted sum: 'val_accuracy+val_accuracy_worst', "
                        "'val_accuracy-10*val_psi' (default: val_accuracy)")
    p.add_argument("--last", type=int, default=5,
                   help="the objective is the mean over this many last evaluations (default: 5)")
    p.add_argument("--rounds", type=int, default=None,
                   help="cap every trial at this many rounds (a shortened study for quick iteration)")
    p.add_argument("--space", default=None, help="search space file (YAML or JSON; default: the built-in one, "
                                                 "written to <study-dir>/search_space.yaml)")
    p.add_argument("--sampler", default="tpe", choices=["tpe", "grid"],
                   help="tpe: Optuna's TPE (the config's own values first); grid: every combination of a space of "
                        "categorical choices, in a seeded random order, none twice (default: tpe)")
    p.add_argument("--sampler-seed", "--sampler_seed", dest="sampler_seed", type=int, default=0,
                   help="seed of the sampler (default: 0)")
    p.add_argument("--jobs", type=int, default=1,
                   help="trials run at a time, each its own fedfdp.fit process (default: 1); see Parallel trials")
    p.add_argument("--batch", type=int, default=1,
                   help="trials fitted together in this process, one batched per-sample pass per round (python -m "
                        "fedfdp.experiments sweep's engine; algorithms it cannot batch are refused); default 1")
    p.add_argument("--startup-trials", "--startup_trials", dest="startup_trials", type=int, default=10,
                   help="TPE's random start-up trials before it models the results (Optuna's n_startup_trials; "
                        "default 10)")
    p.add_argument("--wandb", default=None, choices=["auto", "online", "offline", "disabled"],
                   help="W&B mode of the trial runs (default: fedfdp.fit's)")
    add_dry_run(p)
    p.add_argument("--fit-args", "--fit_args", dest="fit_args", nargs=argparse.REMAINDER, default=None,
                   help="extra arguments passed to every fedfdp.fit call (last option)")
    p.set_defaults(func=run)
