"""Faults in what fedfdp reads, closed as classes (issue "Faults found by a generator", items 1 and 2).

* The working directory never shadows fedfdp's plugin packages: a ``callbacks.py`` or a
  ``datamodules/`` folder where a user runs ``python -m fedfdp.fit`` is not imported instead of fedfdp's.
* Every YAML fedfdp reads refuses a key given twice (configs, saved configs, search spaces, sweep
  grids, YAML values on the command line), where PyYAML would keep the last value silently.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from fedfdp import strict_yaml
from fedfdp.fit import main as fit_main
from tests.conftest import REPO

TINY = REPO / "tests" / "configs" / "tiny_dpfedavg.yaml"


@pytest.mark.parametrize("name", ["callbacks", "datamodules"])
def test_the_plugin_packages_resolve_to_fedfdps_whatever_sys_path_holds(name, tmp_path, monkeypatch):
    (tmp_path / f"{name}.py").write_text("raise SystemExit('shadowed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin == str(REPO / name / "__init__.py")


@pytest.mark.slow
def test_a_run_from_a_directory_holding_callbacks_and_datamodules_uses_fedfdps(tmp_path):
    (tmp_path / "callbacks.py").write_text("raise SystemExit('the user callbacks.py was imported')\n")
    (tmp_path / "datamodules").mkdir()
    (tmp_path / "datamodules" / "__init__.py").write_text("raise SystemExit('the user datamodules was imported')\n")
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run([sys.executable, "-m", "fedfdp.fit", "--config", str(TINY), "--model.num_rounds", "1",
                           "--run_dir", str(tmp_path / "run")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "summary.json").is_file()


def test_the_strict_loader_refuses_a_key_given_twice_at_any_depth():
    assert strict_yaml.load("a: {b: 1, c: 2}\nd: [1, {e: 3}]\n") == {"a": {"b": 1, "c": 2}, "d": [1, {"e": 3}]}
    for text, key in [("a: 1\na: 2\n", "a"), ("m:\n  x: 1\n  y: 2\n  x: 3\n", "x"), ("l: [{k: 1, k: 2}]\n", "k")]:
        with pytest.raises(strict_yaml.DuplicateKeyError, match=rf"the key '{key}' is given twice"):
            strict_yaml.load(text)
    assert strict_yaml.load("b: &b {x: 1}\no:\n  <<: *b\n  x: 2\n")["o"] == {"x": 2}  # a merge may be overridden


def test_a_config_with_a_key_given_twice_is_one_line(tmp_path, capsys):
    text = TINY.read_text().replace("  num_rounds: 2\n", "  num_rounds: 2\n  eval_every: 1\n  num_rounds: 5\n", 1)
    assert text.count("num_rounds") == 2
    config = tmp_path / "twice.yaml"
    config.write_text(text)
    assert fit_main(["--config", str(config), "--run_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(config) in err[0] and "num_rounds" in err[0] and "twice" in err[0], err
    assert not (tmp_path / "run").exists()


def test_a_yaml_value_on_the_command_line_with_a_key_given_twice_is_refused(tmp_path, capsys):
    value = "{class_path: fedfdp.algorithms.FedAvg, init_args: {lr: 0.1, lr: 0.5}}"
    assert fit_main(["--config", str(TINY), "--model.algorithm", value, "--run_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ")


def test_a_search_space_with_a_key_given_twice_is_one_line(tmp_path):
    from fedfdp.experiments.search_space import TuneError, load_space

    space = tmp_path / "space.yaml"
    space.write_text("model.algorithm.init_args.lr: {type: float, low: 0.1, high: 1.0}\n"
                     "model.algorithm.init_args.lr: {type: float, low: 0.2, high: 2.0}\n")
    with pytest.raises(TuneError, match=r"the key 'model.algorithm.init_args.lr' is given twice \(lines 1 and 2\)"):
        load_space(str(space))


# ---- a write that fails: a full disk, a read-only folder, a quota ------------------------------------
@pytest.mark.parametrize("code", ["ENOSPC", "EROFS", "EACCES", "EDQUOT"])
@pytest.mark.parametrize("writer", ["summary", "ledger"])
def test_a_failed_write_is_one_line_naming_the_file_and_leaves_no_half_file(writer, code, tmp_path, monkeypatch,
                                                                           capsys):
    import errno
    import pathlib

    import fedfdp.privacy.ledger_file as ledger_file

    number = getattr(errno, code)
    if writer == "summary":  # the atomic summary's temporary file
        real = pathlib.Path.write_text

        def write_text(self, *args, **kwargs):
            if self.name.endswith(".tmp"):
                real(self, "", encoding="utf-8")  # a write that fails part of the way
                raise OSError(number, os.strerror(number), str(self))
            return real(self, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "write_text", write_text)
    else:  # the privacy ledger's fsync, before a round's uploads leave
        def fsync(fd):
            raise OSError(number, os.strerror(number))

        monkeypatch.setattr(ledger_file.os, "fsync", fsync)
    run_dir = tmp_path / "run"
    assert fit_main(["--config", str(TINY), "--model.num_rounds", "2", "--run_dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and f"errno {code}" in err[-1] and "--ckpt_path last" in err[-1], err[-3:]
    if writer == "summary":
        assert "summary.json.tmp" in err[-1]
    assert not list(run_dir.rglob("*.tmp")) and not (run_dir / "run.lock").exists()
