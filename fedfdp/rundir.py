"""The run directory: the one owner of its file names; one run per directory, and a resume that is the same run.

A run directory (``--run_dir``) holds one run: ``config.yaml``, ``metrics.csv``, ``checkpoints/``,
``summary.json``, ``report.md``, ``privacy_ledger.jsonl`` (:class:`RunPaths`; every module that
reads or writes one of them takes its name from here). The command line (:mod:`fedfdp.cli.parser`)
uses this module, before it writes anything, to

* refuse a fresh start into a directory that already holds a run (:func:`run_files`);
* refuse a resume whose configuration differs from the saved ``config.yaml`` in anything that
  changes the run (:func:`config_differences`, allow-list :data:`HARMLESS`);
* resume from the saved ``config.yaml`` when no ``--config`` is given (:func:`with_saved_config`).

A second process is kept out of a busy directory by :class:`fedfdp.runlock.RunLock`.

Only the standard library, PyYAML and :mod:`fedfdp.errors` are imported here (no torch).
"""

from __future__ import annotations

import csv
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedfdp import strict_yaml
from fedfdp.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

# ---- the run directory's files: their names are written here and nowhere else ----------------------
CONFIG_NAME = "config.yaml"
"""The resolved configuration (LightningCLI's config callback), what a resume is compared with."""
LOCK_NAME = "run.lock"
"""Held by the process that runs in the directory (:class:`fedfdp.runlock.RunLock`)."""
METRICS_NAME = "metrics.csv"
"""One row per round (:class:`fedfdp.runlog.RunCSVLogger`)."""
HPARAMS_NAME = "hparams.yaml"
"""The run's configuration as the CSV logger records it."""
SUMMARY_NAME = "summary.json"
"""The run's results and status (``callbacks.RunSummary``), rewritten after every evaluation."""
REPORT_NAME = "report.md"
"""The run's report (:mod:`fedfdp.report`), with its figures in :data:`PLOTS_DIR`."""
PLOTS_DIR = "plots"
LEDGER_NAME = "privacy_ledger.jsonl"
"""The durable privacy ledger (:mod:`fedfdp.privacy.ledger_file`; other processes' ranks beside it)."""
CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_FILENAME = "round-{step}"
"""Lightning's ``ModelCheckpoint`` file name of a round's checkpoint (``round-<global step>.ckpt``)."""
LAST_CHECKPOINT = f"{CHECKPOINTS_DIR}/last.ckpt"
"""The latest checkpoint (``ModelCheckpoint(save_last=True)``), what ``--ckpt_path last`` resumes."""
SIA_NAME = "sia.json"
"""The source-inference audit's per-client record (``callbacks.SourceInferenceAudit``)."""
DEPLOYMENT_RECORD_NAME = "flower_clients.json"
"""A Flower deployment's record of its clients (:mod:`fedfdp.flower.server_app`)."""
LOG_NAME = "fit.log"
"""The run's output, as the experiment harness (:mod:`fedfdp.experiments.runner`) keeps it."""
HARNESS_NAME = "harness.json"
"""The harness's record of the command it ran, its exit status and wall time."""


@dataclass(frozen=True)
class RunPaths:
    """The paths of a run directory's files (``RunPaths(run_dir).summary``, ...)."""

    root: Path

    def __init__(self, root: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        return self.root / CONFIG_NAME

    @property
    def lock(self) -> Path:
        return self.root / LOCK_NAME

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_NAME

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY_NAME

    @property
    def report(self) -> Path:
        return self.root / REPORT_NAME

    @property
    def plots(self) -> Path:
        return self.root / PLOTS_DIR

    @property
    def ledger(self) -> Path:
        return self.root / LEDGER_NAME

    def ledger_files(self) -> list[Path]:
        """Every process's ledger file (``privacy_ledger.jsonl``, ``privacy_ledger.rank<r>.jsonl``)."""
        stem, suffix = Path(LEDGER_NAME).stem, Path(LEDGER_NAME).suffix
        return sorted(self.root.glob(f"{stem}*{suffix}"))

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    @property
    def last_checkpoint(self) -> Path:
        return self.root / LAST_CHECKPOINT

    @property
    def sia(self) -> Path:
        return self.root / SIA_NAME

    @property
    def deployment_record(self) -> Path:
        return self.root / DEPLOYMENT_RECORD_NAME

    @property
    def log(self) -> Path:
        return self.root / LOG_NAME

    @property
    def harness(self) -> Path:
        return self.root / HARNESS_NAME


#: Dotted config paths a resume may change: they only affect logging, progress display, where
#: things are read from, or how this invocation starts. Everything else (``model.*``, ``data.*``,
#: ``seed_everything``, ``trainer.callbacks`` entries, other ``trainer.*`` fields, ``optimizer``,
#: ``lr_scheduler``) changes the run and is refused. Prefixes match their whole subtree.
#:
#: * ``run_dir``, ``ckpt_path``, ``config``, ``print_config``, ``checkpoint_every``: how this
#:   invocation starts and how often it saves;
#: * ``wandb``, ``wandb_project``, ``wandb_group``, ``trainer.logger``, ``trainer.log_every_n_steps``,
#:   ``trainer.enable_progress_bar``, ``trainer.enable_model_summary``: what is logged or shown;
#: * ``data.init_args.data_dir``, ``data.init_args.download``, ``data.init_args.verify``: where the
#:   dataset files are found (a resume on another machine); the checkpoint's partition
#:   fingerprint still refuses data that partition differently.
#:
#: ``model.num_rounds`` is special: a resume may raise it (or set it to null, i.e. run until the
#: privacy budget stops the run), which extends the run; lowering it is refused.
HARMLESS: frozenset[str] = frozenset({
    "run_dir", "ckpt_path", "config", "print_config", "checkpoint_every",
    "wandb", "wandb_project", "wandb_group",
    "trainer.logger", "trainer.log_every_n_steps", "trainer.enable_progress_bar", "trainer.enable_model_summary",
    "data.init_args.data_dir", "data.init_args.download", "data.init_args.verify",
})
NUM_ROUNDS = "model.num_rounds"
_ABSENT = object()
_MAX_LISTED = 6


# ---- configuration differences --------------------------------------------------------------------
def _flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted path, leaf value)`` pairs; list items are ``path[i]``; empty dicts/lists are leaves."""
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list) and value and any(isinstance(v, dict | list) for v in value):
        for index, item in enumerate(value):
            yield from _flatten(item, f"{prefix}[{index}]")
    else:
        yield prefix, value


def _harmless(path: str) -> bool:
    return any(path == h or path.startswith(h + ".") or path.startswith(h + "[") for h in HARMLESS)


def _extends(saved: Any, new: Any) -> bool:
    """Whether ``model.num_rounds`` going from ``saved`` to ``new`` extends (or keeps) the run."""
    if new == saved or new is None:
        return True
    return isinstance(saved, int) and isinstance(new, int) and new > saved


def _fmt(value: Any) -> str:
    if value is _ABSENT:
        return "<absent>"
    return json.dumps(value) if not isinstance(value, str) else value


def config_differences(saved: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The run-changing differences between two resolved configs, as ``"path: saved X, new Y"``.

    Fields under :data:`HARMLESS` are ignored; ``model.num_rounds`` may grow. A changed
    ``class_path`` is reported once, not with every ``init_args`` under it. A key missing on
    one side counts as null there.
    """
    old_flat, new_flat = dict(_flatten(saved)), dict(_flatten(new))
    changed_classes: list[str] = []
    out: list[str] = []
    for path in sorted(set(old_flat) | set(new_flat), key=lambda p: (p.count("."), p)):
        old, cur = old_flat.get(path, _ABSENT), new_flat.get(path, _ABSENT)
        if (None if old is _ABSENT else old) == (None if cur is _ABSENT else cur) or _harmless(path):
            continue
        if path == NUM_ROUNDS and _extends(old, cur):
            continue
        if any(path.startswith(c + ".") or path.startswith(c + "[") for c in changed_classes):
            continue
        if path.endswith(".class_path"):
            changed_classes.append(path[: -len(".class_path")])
        note = " (may only be raised on resume)" if path == NUM_ROUNDS else ""
        out.append(f"{path}: saved {_fmt(old)}, new {_fmt(cur)}{note}")
    return out


def differing_settings(configs: list[dict[str, Any]]) -> list[tuple[str, list[Any]]]:
    """The settings in which resolved configs differ: ``(dotted path, [value in each config])``, paths
    under :data:`HARMLESS` left out (where a run is and how it is shown), a key missing as null."""
    flats = [dict(_flatten(config)) for config in configs]
    paths = sorted(set().union(*flats), key=lambda p: (p.count("."), p)) if flats else []
    return [(path, values) for path in paths if not _harmless(path)
            for values in [[flat.get(path) for flat in flats]] if any(v != values[0] for v in values)]


def check_resume(run_dir: Path, saved: dict[str, Any], new: dict[str, Any]) -> None:
    """Raise :class:`ConfigError` (one line) if resuming ``run_dir`` with ``new`` changes the run."""
    diffs = config_differences(saved, new)
    if not diffs:
        return
    listed = "; ".join(diffs[:_MAX_LISTED]) + (f"; and {len(diffs) - _MAX_LISTED} more" if len(diffs) > _MAX_LISTED
                                               else "")
    raise ConfigError(
        f"cannot resume {run_dir} with a different configuration: {listed}. A resume continues the run of "
        f"{run_dir / CONFIG_NAME} (it may only change logging options and raise model.num_rounds); "
        f"start a new run with another --run_dir to change it")


# ---- run directory contents --------------------------------------------------------------------
def run_files(run_dir: Path) -> list[str]:
    """The files of an earlier run's results in ``run_dir`` (empty when there is none).

    Results are a summary, a checkpoint, a privacy ledger with a release, or metrics of a round. A
    start that failed before its first round leaves at most ``config.yaml`` and a header-only
    ``metrics.csv``: that directory holds no results and a corrected command may start in it.
    """
    if not run_dir.is_dir():
        return []
    paths = RunPaths(run_dir)
    found = [SUMMARY_NAME] if paths.summary.is_file() else []
    if paths.metrics.is_file() and _has_lines(paths.metrics, 2):
        found.append(METRICS_NAME)
    if paths.checkpoints.is_dir() and any(paths.checkpoints.iterdir()):
        found.append(f"{CHECKPOINTS_DIR}/")
    found += sorted(p.name for p in paths.ledger_files() if _has_lines(p, 1))
    return found


def _has_lines(path: Path, count: int) -> bool:
    """Whether ``path`` has at least ``count`` non-empty lines (reads only as far as needed)."""
    seen = 0
    with path.open("rb") as f:
        for line in f:
            seen += bool(line.strip())
            if seen >= count:
                return True
    return False


def _option(argv: Sequence[str], *names: str) -> tuple[bool, str | None]:
    """Whether an option of ``names`` is in ``argv``, and its last value (``--name value`` or ``--name=value``)."""
    found, value = False, None
    for index, arg in enumerate(argv):
        for name in names:
            if arg == name:
                found, value = True, argv[index + 1] if index + 1 < len(argv) else None
            elif arg.startswith(name + "="):
                found, value = True, arg[len(name) + 1:]
    return found, value


def with_saved_config(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--config RUN_DIR/config.yaml`` first when it resumes without a ``--config``.

    ``--run_dir DIR --ckpt_path X`` resumes the run in ``DIR`` from its saved configuration;
    anything else is returned unchanged.
    """
    argv = list(argv)
    has_config, _ = _option(argv, "--config", "-c")
    has_ckpt, ckpt = _option(argv, "--ckpt_path")
    _, run_dir = _option(argv, "--run_dir")
    if has_config or not has_ckpt or ckpt in (None, "null") or not run_dir:
        return argv
    saved = Path(run_dir) / CONFIG_NAME
    if not saved.is_file():
        raise ConfigError(f"run_dir {run_dir} has no {CONFIG_NAME} to resume from; give the run's --config "
                          f"(or the --run_dir of an earlier run)")
    logger.info("resuming %s with its saved configuration %s", run_dir, saved)
    return ["--config", str(saved), *argv]


def check_run_files(run_dir: Path) -> None:
    """Refuse a resume whose run directory holds a file of the run in a state the run cannot use, before
    anything is written: a folder (or anything but a file) where the run keeps a file, or a
    ``config.yaml``, ``metrics.csv``, ``summary.json`` or ``hparams.yaml`` that cannot be read whole
    (the run would build its results on a half-read file, or fail after training its rounds).
    The privacy ledger and the checkpoint are checked by their own readers, also before any write.

    Raises:
        DataError: one line naming the file and what to do.
    """
    paths = RunPaths(run_dir)
    kept = [paths.config, paths.metrics, paths.summary, paths.report, paths.log, run_dir / HPARAMS_NAME,
            paths.last_checkpoint, *paths.ledger_files()]
    fix = "restore it from a copy, or remove it (the run then keeps no such record), or choose another --run_dir"
    for path in kept:
        if path.exists() and not path.is_file():
            raise DataError(f"run_dir {run_dir}: {path.relative_to(run_dir)} is a folder (or not a file) where the "
                            f"run keeps a file; {fix}")
    readers = {paths.config: _read_mapping, paths.metrics: _read_metrics, paths.summary: _read_json_object,
               run_dir / HPARAMS_NAME: _read_yaml}
    for path, read in readers.items():
        if path.is_file():
            try:
                read(path)
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, strict_yaml.YAMLError) as err:
                raise DataError(f"run_dir {run_dir}: {path.name} cannot be read ({' '.join(str(err).split())[:200]}); "
                                f"{fix}") from err


def _read_mapping(path: Path) -> None:
    if not isinstance(strict_yaml.load(path.read_text(encoding="utf-8")), dict):
        raise ValueError("not a YAML mapping")


def _read_yaml(path: Path) -> None:
    strict_yaml.load(path.read_text(encoding="utf-8"))


def _read_json_object(path: Path) -> None:
    if not isinstance(json.loads(path.read_text(encoding="utf-8")), dict):
        raise ValueError("not a JSON object")


def _read_metrics(path: Path) -> None:
    """``metrics.csv`` as the run's logger reads it: a header with ``step``, every row's step a number."""
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "step" not in reader.fieldnames:
            raise ValueError("no header with a 'step' column")
        for number, row in enumerate(reader, start=2):
            if None in row or any(v is None for v in row.values()):
                raise ValueError(f"line {number} does not have the header's columns")
            if row.get("step") not in ("", None):
                float(row["step"])
