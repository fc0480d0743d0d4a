"""``tune --sampler grid``: every point of an all-categorical search space once, across resumed sessions.

Optuna's GridSampler gives trial ``n < grid size`` the ``n``-th point of an order shuffled by the
sampler's seed, without looking at the study. The tune harness seeds its sampler afresh each session
(a resumed TPE study must not draw its first values again), so a grid study resumed after an
interruption ran points it already held and left others out: the RC-DPFL lr grid's digits DPFedAvg
study ran lr 0.025 and 0.1 twice and 0.2 and 0.4 never. :func:`grid_sampler` gives each new trial
the first point, in the session's order, that no finished, failed or running trial holds, compared
by value (grid ids depend on the seed), and :func:`grid_trials_to_ask` counts the trials a session
asks for in points left, not trials run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fedfdp.experiments.search_space import TuneError, grid_size, grid_space

__all__ = ["grid_points_held", "grid_sampler", "grid_trials_to_ask"]


def grid_sampler(space: dict[str, Any], seed: int, taken: Sequence[Any] = ()) -> Any:
    """The grid sampler of ``space`` (order seeded by ``seed``); ``taken``: trials of another storage
    (a dry run's in-memory study stands in for the stored one) whose points count as held."""
    import optuna

    held = grid_points_held(space, taken)
    given: list[int] = []

    class AskTellGridSampler(optuna.samplers.GridSampler):
        """GridSampler for ask-and-tell that never gives a point twice (see the module docstring).

        GridSampler ends a study with ``Study.stop()`` after its last point, which Optuna allows
        only inside ``Study.optimize``: in this ask-and-tell loop it raised after the last value
        was stored and before ``best.yaml`` was written. The loop stops by counting instead.
        """

        def before_trial(self, study: Any, trial: Any) -> None:
            if "grid_id" in trial.system_attrs or "fixed_params" in trial.system_attrs:
                return
            others = [t for t in study._storage.get_all_trials(study._study_id, deepcopy=False)  # noqa: SLF001
                      if t.number != trial.number]
            # a trial asked this session holds its point before its parameters are drawn
            points = held | grid_points_held(space, others) | {tuple(self._all_grids[i]) for i in given}
            free = [i for i, point in enumerate(self._all_grids) if tuple(point) not in points]
            if not free:  # the loop asks only for points left (grid_trials_to_ask): a bug if reached
                raise TuneError("the grid has no point left that the study does not hold")
            given.append(free[0])
            study._storage.set_trial_system_attr(trial._trial_id, "search_space", self._search_space)  # noqa: SLF001
            study._storage.set_trial_system_attr(trial._trial_id, "grid_id", free[0])  # noqa: SLF001

        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            return None

    return AskTellGridSampler(grid_space(space), seed=seed)


def grid_points_held(space: dict[str, Any], trials: Sequence[Any]) -> set[tuple[Any, ...]]:
    """The grid points (values in the order of the sorted keys, as Optuna's GridSampler orders them)
    that a finished, failed or running trial of ``trials`` holds."""
    from optuna.trial import TrialState

    names = sorted(grid_space(space))
    holding = (TrialState.COMPLETE, TrialState.FAIL, TrialState.RUNNING)
    return {tuple(t.params[n] for n in names) for t in trials
            if t.state in holding and all(n in t.params for n in names)}


def grid_trials_to_ask(space: dict[str, Any], trials: Sequence[Any], wanted: int) -> int:
    """New trials a grid study asks for: the points it does not hold, up to ``wanted`` distinct points
    in all. Points, not trials: a study may hold a point twice (run by a version before this module)."""
    size = grid_size(space)
    return max(0, min(wanted, size) - len(grid_points_held(space, trials)))

