"""File faults of a tuning study's folder, found by a generator: every file ``tune`` keeps, broken, then the study resumed.

A study of one finished trial (``tests/configs/tiny_fedfdp.yaml``, 2 rounds) has its files broken one
at a time, each in every way of :data:`tests.cli.test_file_faults.FAULTS` (truncated, junk bytes,
emptied, a key given twice, a directory in its place, removed, another study's file), and the same
``tune`` command is run again for two trials. The files are what the study folder holds besides its
trial run directories (whose files ``tests/cli/test_file_faults.py`` breaks), listed from the folder,
not by hand. Every case ends in exit 0 with an honest study (trial 0's value kept, two trials finished)
or in exit 2 with one ``error:`` line naming the file and nothing of the folder changed; never a
traceback, and never a best config built from a half-read file.

Faults it found, fixed in ``fedfdp.experiments.tune``: a truncated, junk or unreadable ``study.db``
and a folder in place of any of the files ended in a traceback (now one line, before anything is
written). A sample runs in every test run; all with ``pytest -m file_fuzz
tests/experiments/test_study_file_faults.py``.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import optuna
import pytest

from fedfdp.experiments.__main__ import main
from tests.cli.test_checkpoint_inputs import _state
from tests.cli.test_file_faults import FAULTS, _break
from tests.conftest import REPO

TINY = REPO / "tests" / "configs" / "tiny_fedfdp.yaml"
FILES = ["study.db", "search_space.yaml", "best.yaml", "best.json", "trials.txt"]


def _tune(study_dir: Path, trials: int, seed: int = 0) -> int:
    return main(["tune", "--config", str(TINY), "--study-dir", str(study_dir), "--rounds", "2",
                 "--trials", str(trials), "--sampler-seed", str(seed)])


@pytest.fixture(scope="module")
def studies(tmp_path_factory) -> tuple[Path, Path]:
    """A study with one finished trial, and another study's folder (sampler seed 1)."""
    root = tmp_path_factory.mktemp("studies")
    assert _tune(root / "study", 1) == 0
    assert _tune(root / "other", 1, seed=1) == 0
    return root / "study", root / "other"


def test_the_files_are_what_a_study_folder_holds(studies):
    study, _ = studies
    held = sorted(p.name for p in study.iterdir() if p.is_file())
    assert set(held) <= set(FILES) | {"tune.log"}, held
    assert set(FILES) <= set(held)


CASES = [(f, fault) for f in FILES for fault in FAULTS]
#: in every test run: one fault (chosen by a fixed hash) for the database and two of the files the study rewrites
SAMPLE = [min((c for c in CASES if c[0] == f), key=lambda c: zlib.crc32(repr(c).encode()))
          for f in ("study.db", "best.json", "search_space.yaml")]


def _case(studies, tmp_path, capsys, file: str, fault: str) -> None:
    study, other = studies
    work = tmp_path / "study"
    shutil.copytree(study, work)
    value0 = optuna.load_study(study_name="study", storage=f"sqlite:///{study / 'study.db'}").trials[0].value
    target = work / file
    if fault == "another run's":
        target.unlink()
        shutil.copyfile(other / file, target)
    else:
        _break(target, fault)
    before = _state(work)
    capsys.readouterr()
    code = _tune(work, 2)
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.strip()]
    label = f"{file} {fault}"
    assert code in (0, 2), f"{label}: exit {code}\n" + "\n".join(err[-15:])
    assert not any("Traceback" in line for line in err), f"{label}:\n" + "\n".join(err[-15:])
    if code == 2:
        assert err and err[-1].startswith("error: "), f"{label}: {err[-5:]}"
        assert _state(work) == before, f"{label}: a refused study changed its folder"
        return
    trials = optuna.load_study(study_name="study", storage=f"sqlite:///{work / 'study.db'}").trials
    states = [t.state.name for t in trials]
    # trial 1 may fail on its own (the default space reaches sample rates below one record a batch)
    assert len(trials) == 2 and states[0] == "COMPLETE" and states[1] in ("COMPLETE", "FAIL"), f"{label}: {states}"
    assert trials[0].value == value0, f"{label}: trial 0's value changed"
    best = json.loads((work / "best.json").read_text())
    assert best["value"] == max(t.value for t in trials if t.state.name == "COMPLETE"), label
    assert best["trials_finished"] + best["trials_failed"] == 2, f"{label}: {best}"


@pytest.mark.slow
@pytest.mark.parametrize("file,fault", SAMPLE, ids=[f"{f}|{k}" for f, k in SAMPLE])
def test_a_broken_study_file_sample(studies, tmp_path, capsys, file, fault):
    _case(studies, tmp_path, capsys, file, fault)


@pytest.mark.file_fuzz
@pytest.mark.parametrize("file,fault", CASES, ids=[f"{f}|{k}" for f, k in CASES])
def test_every_broken_study_file(studies, tmp_path, capsys, file, fault):
    _case(studies, tmp_path, capsys, file, fault)
