"""``tune --sampler grid`` across interrupted and resumed sessions (fedfdp.experiments.grid_sampler):
every point of the grid runs once, whatever the interruptions, and a study that holds a point twice
asks only the points left."""

from __future__ import annotations

import numpy as np
import optuna
import pytest
import yaml
from optuna.trial import TrialState

from fedfdp.experiments.grid_sampler import grid_trials_to_ask
from fedfdp.experiments.search_space import grid_size, grid_space, sample_overrides
from fedfdp.experiments.tune import _sampler
from tests.experiments.test_tune import GRID, _tune


LR_GRID = {"model.algorithm.init_args.lr": {"type": "categorical", "choices": [0.025, 0.05, 0.1, 0.2, 0.4]}}


def _points(trial, space):
    return tuple(trial.params[k] for k in sorted(grid_space(space)))


@pytest.mark.parametrize("space", [GRID, LR_GRID], ids=["two_keys_named_choices", "lr"])
@pytest.mark.parametrize("schedule", range(12))
def test_a_grid_study_interrupted_and_resumed_any_way_runs_every_point_once(space, schedule):
    """Sessions as the tune loop runs them (a fresh sampler seed per session, the interrupted trials
    finished first, then one new trial per point left), each cut at a random point with up to two
    trials running: every point of the grid runs once, and nothing more is asked. Before the grid
    sampler looked at the study, a resumed study ran points twice and left others out."""
    rng = np.random.default_rng(schedule)
    study = optuna.create_study(direction="maximize")
    size, asked = grid_size(space), 0
    for session in range(20):
        running = [t for t in study.trials if t.state == TrialState.RUNNING]
        for t in running:  # interrupted trials: finished from their checkpoint with their own values
            study.tell(t.number, 1.0)
        todo = grid_trials_to_ask(space, study.trials, wanted=50)
        if not todo:
            break
        study.sampler = _sampler("grid", space, seed=0, trials_so_far=len(study.trials))
        cut = int(rng.integers(1, todo + 1))  # this session asks `cut` trials, the last ones left running
        for k in range(cut):
            trial = study.ask()
            sample_overrides(trial, space)
            asked += 1
            if k < cut - int(rng.integers(0, 3)):
                study.tell(trial.number, float(rng.random()))
    points = [_points(t, space) for t in study.trials]
    assert asked == size == len(points) == len(set(points)), (session, points)
    assert all(t.state == TrialState.COMPLETE for t in study.trials)


def test_a_grid_study_that_holds_a_point_twice_asks_only_the_points_left(tmp_path, capsys):
    """A study an earlier version ran (lr 0.025 and 0.1 twice, 0.2 and 0.4 never): a dry run plans the
    two points left, and the sampler gives exactly those."""
    study_dir = tmp_path / "study"
    study_dir.mkdir()
    study = optuna.create_study(study_name="study", storage=f"sqlite:///{study_dir / 'study.db'}",
                                direction="maximize")
    dist = optuna.distributions.CategoricalDistribution([0.025, 0.05, 0.1, 0.2, 0.4])
    for lr in (0.1, 0.025, 0.05, 0.025, 0.1):
        study.add_trial(optuna.trial.create_trial(params={"model.algorithm.init_args.lr": lr},
                                                  distributions={"model.algorithm.init_args.lr": dist}, value=lr))
    assert grid_trials_to_ask(LR_GRID, study.trials, wanted=5) == 2
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(LR_GRID))
    capsys.readouterr()
    assert _tune(study_dir, "--trials", "5", "--sampler", "grid", "--space", str(space), "--dry-run") == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "fedfdp.fit" in line]
    assert len(lines) == 2 and {line.split("--model.algorithm.init_args.lr ")[1].split()[0] for line in lines} == {
        "0.2", "0.4"}
    study.sampler = _sampler("grid", LR_GRID, seed=0, trials_so_far=5)
    asked = [study.ask() for _ in range(2)]
    assert sorted(sample_overrides(t, LR_GRID)["model.algorithm.init_args.lr"] for t in asked) == [0.2, 0.4]
