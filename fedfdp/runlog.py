"""One ``metrics.csv`` per run, across resumes: Lightning's CSV logger, merging instead of deleting.

Lightning's :class:`~lightning.pytorch.loggers.CSVLogger` deletes an existing ``metrics.csv`` when
it starts, so a resumed run used to lose (or, renamed aside, split) the metrics of its earlier
sessions. :class:`RunCSVLogger` keeps them: every save merges the new rows into the file, one
row per step, the last value of each metric winning, so rounds that are replayed after
resuming from an older checkpoint appear once, with the values of the replay. The file is
rewritten through a temporary file and ``os.replace`` (never half-written), and nothing is
written before the first save: a start refused during setup leaves the file as it was.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from fedfdp.rundir import HPARAMS_NAME, METRICS_NAME


class MergingExperimentWriter(ExperimentWriter):
    """Writes ``metrics.csv`` as one row per step, merged with the rows already in the file.

    Each row starts with ``round`` (1-based: the round whose metrics it holds) and Lightning's
    ``step`` (``round - 1``).
    """

    NAME_METRICS_FILE = METRICS_NAME  # Lightning's names, stated by the run directory's owner
    NAME_HPARAMS_FILE = HPARAMS_NAME

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir=log_dir)
        self._rows: dict[int, dict[str, Any]] | None = None

    def _check_log_dir_exists(self) -> None:
        """Keep an existing ``metrics.csv`` (Lightning's writer deletes it)."""

    def _load(self) -> dict[int, dict[str, Any]]:
        if self._rows is None:
            self._rows = {}
            path = Path(self.metrics_file_path)
            if path.is_file():
                with path.open(newline="") as f:
                    for row in csv.DictReader(f):  # values stay the file's text: rewritten as they were
                        values = {k: v for k, v in row.items() if k and v not in ("", None)}
                        if "step" in values:
                            self._rows.setdefault(int(float(values["step"])), {}).update(values)
        return self._rows

    def save(self) -> None:
        """Merge the recorded metrics into ``metrics.csv`` (atomically)."""
        if not self.metrics:
            return
        rows = self._load()
        for metrics in self.metrics:
            rows.setdefault(int(metrics["step"]), {}).update(metrics)
        self.metrics = []
        for step, row in rows.items():  # Lightning's step is 0-based; the round it logs is step + 1
            row["round"] = step + 1
        keys = ["round", "step", *sorted(set().union(*rows.values()) - {"round", "step"})]
        path = Path(self.metrics_file_path)
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows[step] for step in sorted(rows))
        os.replace(tmp, path)
        self.metrics_keys = keys


class RunCSVLogger(CSVLogger):
    """:class:`CSVLogger` that keeps one ``metrics.csv`` across the sessions of a run (see the module).

    Empty hyper-parameter dictionaries (Lightning logs the module's, which are empty here) are
    not written, so ``hparams.yaml`` is only written with the run's config at the start of training.
    """

    @property
    @rank_zero_experiment
    def experiment(self) -> MergingExperimentWriter:
        """The writer (created on first use; it writes nothing until metrics are saved)."""
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = MergingExperimentWriter(log_dir=self.log_dir)
        return self._experiment

    @rank_zero_only
    def log_hyperparams(self, params: Any = None) -> None:
        """Record hyper-parameters (``hparams.yaml``), unless there are none."""
        if params:
            super().log_hyperparams(params)
