"""One owner of the run directory's file names: :mod:`fedfdp.rundir`.

Every string constant of the package that is one of the run directory's file names (or starts
with one as a path) is in ``fedfdp/rundir.py``; the other modules take the names from there.
The tests themselves keep literals where they check the files on disk.
"""

from __future__ import annotations

import ast

from fedfdp import rundir
from tests.conftest import REPO

NAMES = {rundir.CONFIG_NAME, rundir.LOCK_NAME, rundir.METRICS_NAME, rundir.HPARAMS_NAME, rundir.SUMMARY_NAME,
         rundir.REPORT_NAME, rundir.PLOTS_DIR, rundir.LEDGER_NAME, rundir.CHECKPOINTS_DIR, rundir.LAST_CHECKPOINT,
         rundir.SIA_NAME, rundir.DEPLOYMENT_RECORD_NAME, rundir.LOG_NAME, rundir.HARNESS_NAME}


def _names_a_file(text: str) -> bool:
    return text in NAMES or any(text.startswith(name + "/") for name in NAMES)


def test_only_rundir_names_the_run_directory_files():
    found = []
    for package in ("fedfdp", "callbacks", "datamodules"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path == REPO / "fedfdp" / "rundir.py":
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                          if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                          and node.body and isinstance(node.body[0], ast.Expr)}
            found += [f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                      if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                      and _names_a_file(node.value)]
    assert found == [], "name these through fedfdp.rundir:\n" + "\n".join(found)


def test_run_paths_are_the_names_in_the_run_directory(tmp_path):
    paths = rundir.RunPaths(tmp_path)
    assert paths.summary == tmp_path / "summary.json" and paths.metrics == tmp_path / "metrics.csv"
    assert paths.last_checkpoint == tmp_path / "checkpoints" / "last.ckpt"
    assert paths.ledger == tmp_path / "privacy_ledger.jsonl" and paths.config == tmp_path / "config.yaml"
    (tmp_path / "privacy_ledger.jsonl").write_text("")
    (tmp_path / "privacy_ledger.rank1.jsonl").write_text("")
    assert [p.name for p in paths.ledger_files()] == ["privacy_ledger.jsonl", "privacy_ledger.rank1.jsonl"]


def test_differing_settings_names_each_changed_leaf_and_leaves_out_where_a_run_is():
    from fedfdp.rundir import differing_settings

    a = {"run_dir": "runs/a", "seed_everything": 0, "model": {"algorithm": {"init_args": {"lr": 1.0, "mu": 0.1}}},
         "trainer": {"callbacks": [{"class_path": "callbacks.RDPAccounting", "init_args": {"target_epsilon": 3.52}}]}}
    b = {"run_dir": "runs/b", "seed_everything": 0, "model": {"algorithm": {"init_args": {"lr": 0.5}}},
         "trainer": {"callbacks": [{"class_path": "callbacks.RDPAccounting", "init_args": {"target_epsilon": 2.0}}]}}
    assert differing_settings([a, b]) == [
        ("model.algorithm.init_args.lr", [1.0, 0.5]),
        ("model.algorithm.init_args.mu", [0.1, None]),
        ("trainer.callbacks[0].init_args.target_epsilon", [3.52, 2.0]),
    ]
    assert differing_settings([a, dict(a, run_dir="elsewhere")]) == []
