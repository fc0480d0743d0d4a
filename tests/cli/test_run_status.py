"""Runs that say how they ended: status, exit codes, signals, refused Trainer options, early checks.

* ``summary.json``'s ``status`` is ``completed``, ``budget_spent``, ``diverged`` or ``interrupted``;
* SIGTERM/SIGINT finish the round, checkpoint, write ``interrupted`` and exit 143/130, and
  ``--ckpt_path last`` continues to the same end as an uninterrupted run;
* a Trainer option fedfdp cannot honour is refused with one line naming the equivalent;
* a model that does not fit the data is refused before the run directory is touched, and the
  corrected command then runs in the same directory;
* ``metrics.csv`` has a ``round`` column.
"""

from __future__ import annotations

import csv
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lightning.pytorch import Trainer

from fedfdp.cli.trainer_options import REFUSED_TRAINER_OPTIONS
from fedfdp.fit import main
from tests.conftest import REPO
from tests.cli.test_cli import TINY


def _errors(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _ledger_rounds(run_dir: Path) -> int:
    path = run_dir / "privacy_ledger.jsonl"
    if not path.exists():
        return 0
    return len({json.loads(line)["round"] for line in path.read_text().splitlines() if line.strip()})


# ---- status ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_status_completed_after_num_rounds_and_budget_spent_when_the_budget_sets_the_rounds(tmp_path, capsys):
    assert main(["--config", TINY, "--run_dir", str(tmp_path / "a")]) == 0
    assert _summary(tmp_path / "a")["status"] == "completed"
    budget = ["--model.num_rounds", "null", "--trainer.callbacks.init_args.target_epsilon", "5.0"]
    assert main(["--config", TINY, "--run_dir", str(tmp_path / "b"), *budget]) == 0
    summary = _summary(tmp_path / "b")
    assert summary["status"] == "budget_spent" and summary["rounds_run"] == summary["rounds_planned"] >= 1
    assert summary["epsilon"] <= 5.0


# ---- signals -----------------------------------------------------------------------------------------
ROUNDS = 200
LONG = ["--model.num_rounds", str(ROUNDS), "--model.eval_every", "20", "--trainer.callbacks.init_args.target_epsilon",
        "null"]


def _default_stop_signals() -> None:
    """In the child: default dispositions for the stop signals. A pytest started with ``nohup`` or as a
    shell's background job passes SIGHUP/SIGINT on as ignored, and a run keeps an inherited ignore."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The summary of the same run, never interrupted."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    assert main(["--config", TINY, "--run_dir", str(run_dir), *LONG]) == 0
    return _summary(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_checkpoints_says_interrupted_exits_128_plus_signal_and_resume_reaches_the_same_end(
        tmp_path, capsys, sig, straight):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "fedfdp.fit", "--config", TINY, "--run_dir", str(run_dir), *LONG],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_stop_signals)
    deadline = time.monotonic() + 120
    while _ledger_rounds(run_dir) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + int(sig), stderr
    summary = _summary(run_dir)
    stopped = summary["rounds_run"]
    assert summary["status"] == "interrupted" and 3 <= stopped < ROUNDS
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert _ledger_rounds(run_dir) == stopped  # the checkpoint is at the round boundary: nothing to replay
    report = (run_dir / "report.md").read_text()  # written before the first evaluation too (every 20 rounds)
    assert ("No evaluation yet" in report) == (stopped < 20) and "privacy claim" in report
    if sig != signal.SIGTERM:
        return  # the same path; the resume is checked once

    assert main(["--run_dir", str(run_dir), "--ckpt_path", "last"]) == 0, capsys.readouterr().err
    resumed = _summary(run_dir)
    assert resumed["status"] == straight["status"] == "completed"
    assert resumed["rounds_run"] == straight["rounds_run"] == ROUNDS
    assert resumed["final"] == straight["final"] and resumed["epsilon"] == straight["epsilon"]
    with (run_dir / "metrics.csv").open(newline="") as f:
        rounds = [int(row["round"]) for row in csv.DictReader(f)]
    assert rounds == list(range(1, ROUNDS + 1))  # one row per round, across both sessions


# ---- Trainer options ---------------------------------------------------------------------------------
#: Trainer options that work as in Lightning in a federated run.
WORKING_TRAINER_OPTIONS = {
    "accelerator", "strategy", "devices", "num_nodes", "logger", "callbacks", "enable_progress_bar",
    "enable_model_summary", "log_every_n_steps", "deterministic", "benchmark", "profiler", "detect_anomaly",
    "plugins", "self", "max_epochs",  # max_epochs: fedfdp's default -1 (checked below), any other value refused
}


def test_every_trainer_option_is_either_known_to_work_or_refused():
    """A Lightning upgrade that adds a Trainer option fails here until the option is classified."""
    names = set(inspect.signature(Trainer.__init__).parameters)
    unclassified = names - WORKING_TRAINER_OPTIONS - set(REFUSED_TRAINER_OPTIONS)
    assert not unclassified, f"classify these Trainer options: {sorted(unclassified)}"


@pytest.mark.parametrize(("option", "value", "equivalent"), [
    ("max_steps", "5", "--model.num_rounds"), ("max_epochs", "3", "--model.num_rounds"),
    ("min_steps", "2", "--model.num_rounds"), ("max_time", "00:00:01:00", "SIGTERM"),
    ("fast_dev_run", "true", "--model.num_rounds 1"), ("limit_train_batches", "0.5", "--model.num_rounds"),
    ("val_check_interval", "2", "--model.eval_every"), ("check_val_every_n_epoch", "2", "--model.eval_every"),
    ("accumulate_grad_batches", "2", "local loop"), ("gradient_clip_val", "1.0", "max_grad_norm"),
    ("default_root_dir", "elsewhere", "--run_dir"), ("precision", "bf16-mixed", "float32"),
    ("enable_checkpointing", "false", "--checkpoint_every"), ("barebones", "true", "--wandb disabled"),
])
def test_a_trainer_option_fedfdp_cannot_honour_is_refused_in_one_line(tmp_path, capsys, option, value, equivalent):
    run_dir = tmp_path / "run"
    assert main(["--config", TINY, "--run_dir", str(run_dir), f"--trainer.{option}", value]) == 2
    err = _errors(capsys)
    assert len(err) == 1 and f"trainer.{option}=" in err[0] and equivalent in err[0], err
    assert not run_dir.exists()


@pytest.mark.slow
def test_fedfdp_defaults_and_harmless_values_of_trainer_options_are_accepted(tmp_path, capsys):
    args = ["--trainer.precision", "32-true", "--trainer.enable_checkpointing", "true", "--trainer.inference_mode",
            "true", "--trainer.deterministic", "true"]
    assert main(["--config", TINY, "--run_dir", str(tmp_path / "run"), *args]) == 0, capsys.readouterr().err


def test_wandb_online_without_an_api_key_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    assert main(["--config", TINY, "--run_dir", str(tmp_path / "run"), "--wandb", "online"]) == 2
    err = _errors(capsys)
    assert len(err) == 1 and "API key" in err[0] and "--wandb offline" in err[0]
    assert not (tmp_path / "run").exists()


# ---- model/data mismatches found before the run directory is touched -----------------------------------
NET = "--model.client.init_args.net.init_args."


@pytest.mark.slow
@pytest.mark.parametrize(("args", "message"), [
    ([NET + "num_classes", "3"], "the data has 4 classes: set its num_classes to 4"),
    ([NET + "num_classes", "7"], "the data has 4 classes: set its num_classes to 4"),
    ([NET + "in_features", "32"], "does not accept the data's inputs of shape (1, 8, 8)"),
], ids=["fewer-classes", "more-classes", "input-size"])
def test_a_model_that_does_not_fit_the_data_is_refused_and_the_corrected_command_runs_there(tmp_path, capsys, args,
                                                                                          message):
    run_dir = tmp_path / "run"
    assert main(["--config", TINY, "--run_dir", str(run_dir), *args]) == 2
    err = _errors(capsys)
    assert len(err) == 1 and message in err[0], err
    assert not run_dir.exists()
    run_dir.mkdir()  # even a directory left by an earlier failed start (config.yaml only) is no run
    (run_dir / "config.yaml").write_text("seed_everything: 0\n")
    assert main(["--config", TINY, "--run_dir", str(run_dir)]) == 0, capsys.readouterr().err
    assert _summary(run_dir)["status"] == "completed"


@pytest.mark.slow
def test_metrics_csv_has_a_round_column_equal_to_the_round(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["--config", TINY, "--run_dir", str(run_dir), "--model.num_rounds", "3"]) == 0
    with (run_dir / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["round"]) for r in rows] == [1, 2, 3]
    assert all(int(r["round"]) == int(r["step"]) + 1 for r in rows)
    assert list(rows[0])[:2] == ["round", "step"]


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--trainer.max_steps", "5"], ["--trainer.callbacks.init_args.delta", "0.5"],
                                  [NET + "num_classes", "3"],
                                  ["--model.algorithm", "fedfdp.algorithms.FedAvg",  # without privacy: non-private
                                   "--model.algorithm.init_args.privacy", "null"]],
                         ids=["trainer-option", "delta", "num-classes", "non-private-algorithm"])
def test_a_refused_resume_of_an_earlier_run_changes_none_of_its_files(tmp_path, capsys, args):
    import hashlib

    run_dir = tmp_path / "run"
    assert main(["--config", TINY, "--run_dir", str(run_dir)]) == 0
    capsys.readouterr()
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in run_dir.rglob("*") if p.is_file()}
    assert main(["--config", TINY, "--run_dir", str(run_dir), "--ckpt_path", "last", *args]) == 2
    assert len(_errors(capsys)) == 1
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in run_dir.rglob("*") if p.is_file()} == before
