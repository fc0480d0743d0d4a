"""Damaged and confusing checkpoint files (issue 36): one line naming the file, nothing changed.

* ``--ckpt_path last`` with a truncated, junk, empty, unreadable ``checkpoints/last.ckpt``, a
  directory in its place, or a file that is not a fedfdp checkpoint: exit 2, one ``error:`` line
  naming the file, and no file or folder of the run directory changes (bytes and mtimes).
* ``--ckpt_path last`` resumes from ``checkpoints/last.ckpt`` (the README's name); after a resume
  that file holds the newest round and no ``last-v1.ckpt`` exists.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from fedfdp.fit import main
from tests.cli.test_cli import TINY


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A one-round run with its checkpoints."""
    run_dir = tmp_path_factory.mktemp("ckpt") / "run"
    assert main(["--config", TINY, "--run_dir", str(run_dir), "--model.num_rounds", "1"]) == 0
    return run_dir


def _state(run_dir: Path) -> dict[str, tuple]:
    """Every path under ``run_dir``: a file's bytes and mtime, a folder's mtime."""
    out: dict[str, tuple] = {}
    for path in sorted(run_dir.rglob("*")):
        stat = path.stat()
        out[str(path.relative_to(run_dir))] = (path.read_bytes() if path.is_file() else None, stat.st_mtime_ns)
    return out


def _damage(last: Path, kind: str) -> None:
    data = last.read_bytes()
    if kind == "truncated":
        last.write_bytes(data[: len(data) // 2])
    elif kind == "junk":
        last.write_bytes(bytes(range(256)) * 16)
    elif kind == "empty":
        last.write_bytes(b"")
    elif kind == "directory":
        last.unlink()
        last.mkdir()
    elif kind == "not fedfdp":
        torch.save({"weights": torch.zeros(3)}, last)
    elif kind == "unreadable":
        last.chmod(0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["truncated", "junk", "empty", "directory", "not fedfdp", "unreadable"])
def test_a_damaged_last_checkpoint_is_one_line_and_changes_nothing(tmp_path, capsys, finished_run, kind):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    last = run_dir / "checkpoints" / "last.ckpt"
    _damage(last, kind)
    if kind == "unreadable" and os.access(last, os.R_OK):
        pytest.skip("this user reads a file whatever its mode (root)")
    before = _state(run_dir)
    code = main(["--run_dir", str(run_dir), "--ckpt_path", "last", "--model.num_rounds", "3"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(err) == 1, err
    assert str(last) in err[0] and "nothing was changed" in err[0], err[0]
    assert _state(run_dir) == before


@pytest.mark.slow
def test_a_damaged_explicit_checkpoint_names_the_file(tmp_path, capsys, finished_run):
    run_dir = tmp_path / "run"
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"\x00not a checkpoint")
    code = main(["--config", TINY, "--run_dir", str(run_dir), "--ckpt_path", str(junk)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(err) == 1 and str(junk) in err[0], err
    assert not run_dir.exists()


@pytest.mark.slow
def test_resume_from_last_writes_last_ckpt_and_no_versioned_copy(tmp_path):
    """A resume of a moved run directory (another machine, a renamed folder): Lightning then does not
    recognise the checkpoint's folder, and used to write ``last-v1.ckpt`` beside the older ``last.ckpt``."""
    assert main(["--config", TINY, "--run_dir", str(tmp_path / "first"), "--checkpoint_every", "1"]) == 0
    run_dir = tmp_path / "moved"
    shutil.move(tmp_path / "first", run_dir)
    folder = run_dir / "checkpoints"
    for rounds in (4, 5):
        assert main(["--run_dir", str(run_dir), "--ckpt_path", "last", "--model.num_rounds", str(rounds)]) == 0
        assert sorted(p.name for p in folder.glob("last*.ckpt")) == ["last.ckpt"]
        assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == rounds
