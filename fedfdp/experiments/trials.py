"""One tuning trial: a ``fedfdp.fit`` subprocess per seed, scored on validation metrics only.

The study (:mod:`fedfdp.experiments.tune`) asks Optuna for a trial's values; this module turns
them into ``fedfdp.fit`` runs (dotted command-line overrides on the base config, a held-out
validation fraction of each client's training split, the trial's run directory; resuming its
checkpoint when interrupted) and reads the objective back from each run's ``summary.json``: the
mean over the last ``last`` evaluations of ``Σ weight · val_metric``. Test metrics are never read.
The runs are launched by :class:`fedfdp.experiments.runner.Runner` (``fit.log`` and
``harness.json`` in each run directory).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedfdp.experiments.runner import Runner, RunResult, RunSpec
from fedfdp.experiments.search_space import VAL_KEY, TuneError, cli_value, override_args

__all__ = ["ROUNDS_KEY", "Settings", "fit_command", "objective_value", "parse_objective", "run_fit", "run_spec",
           "run_trial"]

ROUNDS_KEY = "model.num_rounds"
#: Launches the trial runs (W&B as ``--wandb`` or the environment says).
RUNNER = Runner()

_TERM = re.compile(r"\s*([+-])?\s*(?:(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)\s*\*\s*)?"
                   r"([A-Za-z_]\w*)\s*")


# ---- objective -----------------------------------------------------------------------------------
def parse_objective(text: str) -> list[tuple[float, str]]:
    """``"val_accuracy+0.5*val_accuracy_worst"`` -> ``[(1.0, "val_accuracy"), (0.5, "val_accuracy_worst")]``.

    Raises:
        TuneError: when the text is not a signed sum of ``[weight*]metric`` terms or names a
            metric that is not a validation metric (``val_*``).
    """
    terms: list[tuple[float, str]] = []
    pos = 0
    text = text or ""
    while pos < len(text):
        match = _TERM.match(text, pos)
        if match is None or match.end() == pos or (terms and match.group(1) is None):
            raise TuneError(f"--objective must be a sum of [weight*]metric terms such as "
                            f"'val_accuracy+0.5*val_accuracy_worst', got {text!r}")
        sign = -1.0 if match.group(1) == "-" else 1.0
        terms.append((sign * float(match.group(2) or 1.0), match.group(3)))
        pos = match.end()
    if not terms:
        raise TuneError("--objective needs at least one validation metric, e.g. val_accuracy")
    bad = [name for _, name in terms if not name.startswith("val_")]
    if bad:
        raise TuneError(f"--objective uses validation metrics only (val_accuracy, val_accuracy_worst, val_psi, "
                        f"...): trials must not be scored on test data, got {', '.join(bad)}")
    return terms


def objective_value(summary: dict[str, Any], terms: Sequence[tuple[float, str]], last: int) -> float:
    """Mean over the last ``last`` evaluations (``summary["history"]``) of ``Σ weight · metric``.

    Only the named validation metrics are read. Raises ValueError when no evaluation has them
    (a datamodule without a validation split).
    """
    names = [name for _, name in terms]
    rows = [h for h in summary.get("history") or [] if all(name in h for name in names)]
    if not rows:
        raise ValueError(f"summary.json has no evaluation with {', '.join(names)} (does the datamodule support "
                         f"data.init_args.val_fraction?)")
    rows = rows[-last:]
    return sum(sum(w * float(h[name]) for w, name in terms) for h in rows) / len(rows)


# ---- trials --------------------------------------------------------------------------------------
@dataclass
class Settings:
    """What a study is tied to (stored in the study; a resume must give the same)."""

    config: Path
    study_dir: Path
    study_name: str
    val_fraction: float
    objective: str
    terms: list[tuple[float, str]]
    last: int
    rounds: int | None
    seeds: list[int]
    space: dict[str, Any]
    wandb: str | None
    fit_args: list[str]
    sampler: str = "tpe"

    def identity(self) -> dict[str, Any]:
        """The settings a resumed study must share with the one it continues."""
        return {"config": str(self.config.resolve()),
                "config_sha256": hashlib.sha256(self.config.read_bytes()).hexdigest(),
                "val_fraction": self.val_fraction, "objective": self.objective, "last": self.last,
                "rounds": self.rounds, "seeds": list(self.seeds), "space": self.space,
                **({"sampler": self.sampler} if self.sampler != "tpe" else {})}

    def run_dir(self, number: int, seed: int) -> Path:
        base = self.study_dir / f"trial{number}"
        return base if len(self.seeds) == 1 else base / f"seed{seed}"


def run_spec(settings: Settings, run_dir: Path, seed: int, overrides: dict[str, Any]) -> RunSpec:
    """One trial run: the base config with the validation split, the rounds cap and the trial's values."""
    args = ["--trainer.enable_progress_bar", "false", "--wandb_group", settings.study_name,
            f"--{VAL_KEY}", cli_value(settings.val_fraction)]
    if settings.wandb is not None:
        args += ["--wandb", settings.wandb]
    if settings.rounds is not None:
        args += [f"--{ROUNDS_KEY}", str(settings.rounds)]
    args += override_args(overrides) + list(settings.fit_args)
    return RunSpec(run_dir=run_dir, config=settings.config, seed=seed, args=tuple(args))


def fit_command(settings: Settings, run_dir: Path, seed: int, overrides: dict[str, Any]) -> list[str]:
    """The ``fedfdp.fit`` command of one trial run (resuming its checkpoint when it has one)."""
    return RUNNER.command(run_spec(settings, run_dir, seed, overrides))


def run_fit(settings: Settings, run_dir: Path, seed: int, overrides: dict[str, Any]) -> RunResult:
    """Run (or resume, or skip when finished) one trial run."""
    return RUNNER.run(run_spec(settings, run_dir, seed, overrides))


def run_trial(settings: Settings, number: int, overrides: dict[str, Any]) -> tuple[float | None, dict[str, Any]]:
    """Every seed's run of trial ``number``; the objective (None when a run failed) and notes."""
    return trial_result(settings, number, lambda seed, run_dir: run_fit(settings, run_dir, seed, overrides))


def run_trials_together(settings: Settings, trials: list[tuple[int, dict[str, Any]]]
                        ) -> list[tuple[float | None, dict[str, Any]]]:
    """Every seed's run of every trial ``(number, overrides)`` fitted together in this process
    (:meth:`Runner.run_sweep`: one batched pass per round); each trial's objective and notes."""
    specs = [run_spec(settings, settings.run_dir(number, seed), seed, overrides)
             for number, overrides in trials for seed in settings.seeds]
    results = {spec.run_dir: result for spec, result in zip(specs, RUNNER.run_sweep(specs))}
    return [trial_result(settings, number, lambda seed, run_dir: results[run_dir]) for number, _ in trials]


def trial_result(settings: Settings, number: int, fit: Callable[[int, Path], RunResult]
                 ) -> tuple[float | None, dict[str, Any]]:
    """Trial ``number``'s objective (None when a run failed) and notes from ``fit(seed, run_dir)``,
    which runs (or looks up) each seed's run."""
    values, notes = [], {"run_dirs": [], "rounds_run": []}
    for seed in settings.seeds:
        run_dir = settings.run_dir(number, seed)
        result = fit(seed, run_dir)
        summary = result.summary if result.finished else None
        notes["run_dirs"].append(str(run_dir))
        if result.returncode != 0 or summary is None:
            notes["error"] = f"exit status {result.returncode}: {result.error_line} (see {result.log})"
            return None, notes
        try:
            values.append(objective_value(summary, settings.terms, settings.last))
        except ValueError as err:
            notes["error"] = str(err)
            return None, notes
        notes["rounds_run"].append(summary.get("rounds_run"))
        for _, name in settings.terms:  # each term alone (mean of the same last evaluations), for trials.txt
            notes.setdefault(name, []).append(objective_value(summary, [(1.0, name)], settings.last))
        if summary.get("epsilon") is not None:
            notes.setdefault("epsilon", []).append(summary["epsilon"])
    return sum(values) / len(values), notes


def _fmt_value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def write_trials(settings: Settings, study: Any) -> Path:
    """``<study-dir>/trials.txt``: one line per ended trial (trial order), the study's plain-text record.

    Each line: the trial number, its state, the objective, each objective term alone (validation,
    mean of the same last evaluations, averaged over the trial's seeds), the rounds run, the ε
    spent and the sampled values. Rewritten after every trial, so it always matches ``study.db``.
    """
    from optuna.trial import TrialState

    lines = [f"# study {settings.study_name}: objective {settings.objective} (mean of the last {settings.last} "
             f"evaluations, validation split {settings.val_fraction}; test data never read); base config "
             f"{settings.config}"]
    for t in sorted(study.trials, key=lambda t: t.number):
        if t.state not in (TrialState.COMPLETE, TrialState.FAIL):
            continue
        attrs = t.user_attrs
        parts = [f"trial{t.number}", t.state.name]
        if t.state == TrialState.COMPLETE:
            parts.append(f"value {t.value:.4f}")
            for _, name in settings.terms:
                values = attrs.get(name) or []
                if values:
                    parts.append(f"{name} {100 * sum(values) / len(values):.2f}")
        rounds = [r for r in attrs.get("rounds_run") or [] if r is not None]
        if rounds:
            parts.append(f"rounds {'/'.join(str(r) for r in rounds)}")
        eps = attrs.get("epsilon") or []
        if eps:
            parts.append(f"eps {max(eps):.3f}")
        if t.state == TrialState.FAIL and attrs.get("error"):
            parts.append(f"error {str(attrs['error'])[:120]}")
        params = ", ".join(f"{k.rsplit('.', 1)[-1]}={_fmt_value(v)}" for k, v in t.params.items())
        lines.append(" ".join(parts) + (f" | {params}" if params else ""))
    path = settings.study_dir / "trials.txt"
    path.write_text("\n".join(lines) + "\n")
    return path
