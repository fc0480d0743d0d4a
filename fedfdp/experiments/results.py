"""Read finished runs back and tabulate them: what the experiment commands share after launching.

* :func:`read_summary` / :func:`is_finished` / :func:`finished_summary`: a run's ``summary.json``
  and whether the run is done (status ``completed`` or ``budget_spent``, every planned round run,
  every sampled client in every round and every client in the final evaluation);
  :func:`ended_with_missing_clients`: a run that ran every round but left clients out (a
  deployment's lost nodes): not finished, not tabulated, and not run again by the harness.
* :func:`read_metrics`: the rows of a run's ``metrics.csv``.
* :func:`recorded_wall_seconds`: the wall time the runner recorded in ``harness.json``.
* :func:`mean_std`, :func:`format_mean_std`, :func:`group_rows`: mean ± std over seeds.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedfdp.participation import MISSING_CLIENTS_STATUSES, has_missing_clients
from fedfdp.rundir import RunPaths

__all__ = ["FINISHED_STATUSES", "ended_with_missing_clients", "finished_summary", "format_mean_std", "group_rows",
           "is_finished", "mean_std", "read_metrics", "read_summary", "recorded_wall_seconds"]

#: ``summary.json`` statuses of a run that ended as planned (:data:`callbacks.summary.STATUSES`).
FINISHED_STATUSES = ("completed", "budget_spent")


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``summary.json``; None when it is missing or unreadable (a run that never got that far)."""
    try:
        summary = json.loads(RunPaths(run_dir).summary.read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def is_finished(summary: Mapping[str, Any] | None) -> bool:
    """Whether a summary is that of a finished run: every planned round run, status finished, no
    client left out of a round or of the final evaluation (:func:`fedfdp.participation.has_missing_clients`).

    Summaries written before ``status`` existed count by their rounds alone.
    """
    if summary is None:
        return False
    done = summary.get("rounds_run", 0) >= summary.get("rounds_planned", 1)
    status = summary.get("status", FINISHED_STATUSES[0])
    return done and status in FINISHED_STATUSES and not has_missing_clients(summary)


def ended_with_missing_clients(summary: Mapping[str, Any] | None) -> bool:
    """Whether a run ran every planned round but left clients out (status ``*_with_missing_clients``).

    Such a run cannot be completed by a resume (the rounds happened without those clients) and is
    not a complete run: the harness neither tabulates it nor runs it again (move it aside to).
    """
    if summary is None or summary.get("rounds_run", 0) < summary.get("rounds_planned", 1):
        return False
    status = summary.get("status", FINISHED_STATUSES[0])
    return status in MISSING_CLIENTS_STATUSES or (status in FINISHED_STATUSES and has_missing_clients(summary))


def finished_summary(run_dir: Path) -> dict[str, Any] | None:
    """The summary of a finished run in ``run_dir`` (None when it has not finished)."""
    summary = read_summary(run_dir)
    return summary if is_finished(summary) else None


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    """The rows of the run's ``metrics.csv`` as dictionaries of strings (empty when there is none)."""
    path = RunPaths(run_dir).metrics
    if not path.is_file():
        return []
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def recorded_wall_seconds(run_dir: Path) -> float | None:
    """The wall time of the run's last launch, as the runner wrote it to ``harness.json`` (None: none)."""
    try:
        return float(json.loads(RunPaths(run_dir).harness.read_text())["wall_seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def mean_std(values: Sequence[float], ddof: int = 1) -> tuple[float, float]:
    """Mean and standard deviation (``ddof=1``: the sample's; ``0``: the population's); std 0 for one value."""
    arr = np.asarray(values, dtype=float)
    return float(arr.mean()), float(arr.std(ddof=ddof)) if len(arr) > 1 else 0.0


def format_mean_std(values: Sequence[float], fmt: Callable[[float], str], *, ddof: int = 1,
                    empty: str = "—") -> str:
    """``mean±std`` of ``values`` (each through ``fmt``), the mean alone for one value, ``empty`` for none."""
    if not len(values):
        return empty
    mean, std = mean_std(values, ddof)
    return f"{fmt(mean)}±{fmt(std)}" if len(values) > 1 else fmt(mean)


def group_rows(rows: Iterable[Mapping[str, Any]], *keys: str) -> dict[tuple[Any, ...], list[Mapping[str, Any]]]:
    """Rows grouped by the values of ``keys`` (groups and the rows in each in their first-seen order)."""
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row)
    return groups
