"""A generator of file faults (issue "Faults found by a generator", item 1): every file a run
directory holds, broken on purpose, then the run resumed.

The files come from the run directory's owner (:class:`fedfdp.rundir.RunPaths`: every path it
names that a finished run holds), not from a hand-kept list. Each is broken in each way
(:data:`FAULTS`: truncated at a seeded random point, junk bytes, emptied, a key given twice, a
directory in its place, removed, another run's file) and the run is resumed with
``--ckpt_path last --model.num_rounds 2``. Every case must end in exit 0 (a correct, honest run:
two rounds, and ε at least the uninterrupted run's, every release charged) or exit 2 with one
``error:`` line, never a traceback, and a refused resume changes no file.

A sample (:data:`SAMPLE`, one fault per file, chosen by a fixed hash) runs in every test run; all
of them with ``pytest -m file_fuzz tests/cli/test_file_faults.py``.
"""

from __future__ import annotations

import json
import random
import shutil
import zlib
from pathlib import Path

import pytest

from fedfdp.fit import main
from fedfdp.rundir import RunPaths
from tests.cli.test_checkpoint_inputs import _state
from tests.cli.test_cli import TINY

FAULTS = ("truncated", "junk", "empty", "duplicate key", "directory", "missing", "another run's")


def _files(run_dir: Path) -> list[str]:
    """Every file the owner of run directories names that ``run_dir`` holds (relative paths)."""
    paths = RunPaths(run_dir)
    names = [name for name, value in vars(RunPaths).items() if isinstance(value, property)]
    found = {getattr(paths, name) for name in names}
    found.update(paths.ledger_files())
    return sorted(str(p.relative_to(run_dir)) for p in found if p.is_file())


def _break(path: Path, fault: str) -> None:
    data = path.read_bytes()
    rng = random.Random(zlib.crc32(f"{path.name}:{fault}".encode()))
    if fault == "truncated":
        path.write_bytes(data[: rng.randrange(1, max(len(data), 2))])
    elif fault == "junk":
        path.write_bytes(bytes(rng.randrange(256) for _ in range(512)))
    elif fault == "empty":
        path.write_bytes(b"")
    elif fault == "duplicate key":
        if path.suffix in (".yaml", ".json"):
            first = data.decode().lstrip("{ \n").split(":", 1)[0].strip().strip('"')
            text = data.decode()
            path.write_text(text + (f"\n{first}: 1\n" if path.suffix == ".yaml" else ""))
            if path.suffix == ".json":  # JSON: the first key once more, inside the object
                path.write_text("{" + f'"{first}": 1, ' + text.lstrip()[1:])
        else:
            path.write_bytes(data + data[: len(data) // 3])  # lines given twice
    elif fault == "directory":
        path.unlink()
        path.mkdir()
    elif fault == "missing":
        path.unlink()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path, dict]:
    """A finished one-round run, another run's directory (seed 1), and the uninterrupted two-round run's summary."""
    root = tmp_path_factory.mktemp("faults")
    assert main(["--config", TINY, "--run_dir", str(root / "run"), "--model.num_rounds", "1"]) == 0
    assert main(["--config", TINY, "--run_dir", str(root / "other"), "--model.num_rounds", "1",
                 "--seed_everything", "1"]) == 0
    assert main(["--config", TINY, "--run_dir", str(root / "whole"), "--model.num_rounds", "2"]) == 0
    return root / "run", root / "other", json.loads((root / "whole" / "summary.json").read_text())


def _cases() -> list[tuple[str, str]]:
    files = ["config.yaml", "summary.json", "metrics.csv", "privacy_ledger.jsonl", "hparams.yaml",
             "checkpoints/last.ckpt"]
    return [(f, fault) for f in files for fault in FAULTS]


CASES = _cases()
#: one fault per file, chosen by a fixed hash
SAMPLE = [min((c for c in CASES if c[0] == f), key=lambda c: zlib.crc32(repr(c).encode()))
          for f in sorted({c[0] for c in CASES})]


def test_the_cases_cover_every_file_a_run_directory_holds(runs):
    run_dir, _, _ = runs
    assert {f for f, _ in CASES} >= set(_files(run_dir)) - {"fit.log", "report.md"}, _files(run_dir)


def _resume_case(runs, tmp_path, capsys, file: str, fault: str) -> None:
    run_dir, other, whole = runs
    work = tmp_path / "run"
    shutil.copytree(run_dir, work)
    target = work / file
    source = other / file
    if fault == "another run's":
        if target.is_file():
            target.unlink()
        shutil.copyfile(source, target)
    else:
        _break(target, fault)
    before = _state(work)
    capsys.readouterr()
    code = main(["--run_dir", str(work), "--ckpt_path", "last", "--model.num_rounds", "2"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code in (0, 2), f"{file} {fault}: exit {code}\n" + "\n".join(err[-15:])
    assert not any(line.startswith("Traceback") for line in err), "\n".join(err[-15:])
    if code == 2:
        assert err and err[-1].startswith("error: "), err[-5:]
        assert _state(work) == before, f"{file} {fault}: a refused resume changed the run directory"
        return
    summary = json.loads((work / "summary.json").read_text())
    assert summary["rounds_run"] == 2, summary["rounds_run"]
    assert summary["epsilon"] >= whole["epsilon"] - 1e-12, "a release was lost from the ledger"


@pytest.mark.slow
@pytest.mark.parametrize("file,fault", SAMPLE, ids=[f"{f}|{k}" for f, k in SAMPLE])
def test_a_broken_file_sample(runs, tmp_path, capsys, file, fault):
    _resume_case(runs, tmp_path, capsys, file, fault)


@pytest.mark.file_fuzz
@pytest.mark.parametrize("file,fault", CASES, ids=[f"{f}|{k}" for f, k in CASES])
def test_every_broken_file(runs, tmp_path, capsys, file, fault):
    _resume_case(runs, tmp_path, capsys, file, fault)
