"""Resume is the same run, and one run per run directory.

A resume (``--ckpt_path``) keeps the saved ``config.yaml``; a refused start (bad resume, busy or
finished directory, invalid config) changes no file; metrics, summary, report and progress bar
span every session of a run; a lock keeps a second process out of a busy run directory.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedfdp.cli.parser import build_cli
from fedfdp.fit import main
from fedfdp.report import read_series
from tests.conftest import REPO
from tests.cli.test_cli import TINY

ALG = "--model.algorithm.init_args."
PRIV = ALG + "privacy.init_args."  # the privacy mechanism's (fedfdp.privacy.SampleLevelDP) options


def _errors(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def _snapshot(run_dir: Path) -> dict[str, str]:
    """sha256 of every file under ``run_dir`` (recursively), by relative path."""
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _steps(run_dir: Path) -> list[int]:
    with (run_dir / "metrics.csv").open(newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f)]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-round run with noise_multiplier 2.0 (copied by each test that changes it)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    assert main(["--config", TINY, "--run_dir", str(run_dir), PRIV + "noise_multiplier", "2.0"]) == 0
    return run_dir


@pytest.fixture()
def run(finished: Path, tmp_path: Path) -> Path:
    """A private copy of the finished run."""
    return Path(shutil.copytree(finished, tmp_path / "run"))


# ---- 1. a resume keeps the saved configuration ---------------------------------------------------
@pytest.mark.slow
def test_resume_with_a_changed_hyperparameter_is_refused_naming_field_and_values(run, capsys):
    code = main(["--config", TINY, "--run_dir", str(run), PRIV + "noise_multiplier", "1.5", "--ckpt_path", "last"])
    err = _errors(capsys)
    assert code == 2 and len(err) == 1, err
    assert "model.algorithm.init_args.privacy.init_args.noise_multiplier" in err[0], err
    assert "2.0" in err[0] and "1.5" in err[0]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["algorithm"]["init_args"]["privacy"]["init_args"]["noise_multiplier"] == 2.0


@pytest.mark.slow
@pytest.mark.parametrize("args, field", [
    (["--seed_everything", "3"], "seed_everything"),
    (["--data.init_args.alpha", "0.5"], "data.init_args.alpha"),
    (["--trainer.callbacks.init_args.target_epsilon", "20"], "trainer.callbacks[1].init_args.target_epsilon"),
    (["--trainer.accelerator", "auto"], "trainer.accelerator"),
    (["--model.num_rounds", "1"], "model.num_rounds"),  # lowering the round count is a different run
], ids=["seed", "data", "callback", "trainer", "fewer rounds"])
def test_resume_refuses_every_run_changing_field(run, capsys, args, field):
    assert main(["--config", TINY, "--run_dir", str(run), "--ckpt_path", "last", *args]) == 2
    err = _errors(capsys)
    assert len(err) == 1 and field in err[0], err


@pytest.mark.slow
def test_resume_allows_logging_overrides_and_more_rounds(run, capsys):
    code = main(["--config", TINY, "--run_dir", str(run), "--ckpt_path", "last", PRIV + "noise_multiplier", "2.0",
                 "--model.num_rounds", "3", "--trainer.log_every_n_steps", "5", "--wandb", "disabled",
                 "--wandb_project", "other", "--trainer.enable_model_summary", "true", "--checkpoint_every", "2"])
    assert code == 0, _errors(capsys)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds_run"] == 3 and [h["round"] for h in summary["history"]] == [1, 2, 3]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["num_rounds"] == 3
    assert saved["model"]["algorithm"]["init_args"]["privacy"]["init_args"]["noise_multiplier"] == 2.0


@pytest.mark.slow
def test_resume_needs_no_config_it_reads_the_run_directory(run, capsys):
    assert main(["--run_dir", str(run), "--ckpt_path", "last", "--model.num_rounds", "3"]) == 0, _errors(capsys)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds_run"] == 3
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["algorithm"]["init_args"]["privacy"]["init_args"]["noise_multiplier"] == 2.0


def test_resume_without_config_of_a_directory_without_config_yaml_is_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["--run_dir", str(tmp_path / "empty"), "--ckpt_path", "last"]) == 2
    err = _errors(capsys)
    assert len(err) == 1 and "config.yaml" in err[0], err


# ---- 2. a refused start changes no file ----------------------------------------------------------
@pytest.mark.slow
def test_refused_resume_changes_no_file(run, capsys):
    (run / "privacy_ledger.jsonl").write_text('{"round": 0}\n')  # whatever the run dir holds stays as is
    before = _snapshot(run)
    assert main(["--config", TINY, "--run_dir", str(run), PRIV + "noise_multiplier", "1.5", "--ckpt_path", "last"]) == 2
    assert len(_errors(capsys)) == 1
    assert _snapshot(run) == before


@pytest.mark.slow
def test_refused_fresh_start_into_a_finished_run_changes_no_file(run, capsys):
    before = _snapshot(run)
    assert main(["--config", TINY, "--run_dir", str(run), PRIV + "noise_multiplier", "2.0"]) == 2
    err = _errors(capsys)
    assert len(err) == 1 and "already holds" in err[0]
    assert _snapshot(run) == before


def test_fresh_start_into_a_started_run_without_summary_is_refused(run, capsys):
    (run / "summary.json").unlink()  # e.g. a run killed before its first evaluation
    before = _snapshot(run)
    assert main(["--config", TINY, "--run_dir", str(run), PRIV + "noise_multiplier", "2.0"]) == 2
    err = _errors(capsys)
    assert len(err) == 1 and "already holds" in err[0] and "checkpoints/" in err[0], err
    assert _snapshot(run) == before


# ---- 3. metrics, report, summary and progress bar span the whole run ------------------------------
@pytest.mark.slow
def test_metrics_and_report_span_every_session_without_duplicate_rounds(run, capsys):
    older = run / "round-2-copy.ckpt"
    shutil.copy(run / "checkpoints" / "last.ckpt", older)
    assert main(["--run_dir", str(run), "--ckpt_path", "last", "--model.num_rounds", "3"]) == 0, _errors(capsys)
    assert _steps(run) == [0, 1, 2]
    # resume again from the older checkpoint: round 3 is replayed and must not appear twice
    assert main(["--run_dir", str(run), "--ckpt_path", str(older), "--model.num_rounds", "4"]) == 0, _errors(capsys)
    assert _steps(run) == [0, 1, 2, 3]
    assert not list(run.glob("metrics.*resume*"))
    summary = json.loads((run / "summary.json").read_text())
    assert [h["round"] for h in summary["history"]] == [1, 2, 3, 4]
    series = read_series(run, summary)
    for key in ("epsilon", "broadcast_loss", "accuracy"):
        assert [r for r, _ in series[key]] == [1, 2, 3, 4], key
    assert "4 of 4 planned rounds" in (run / "report.md").read_text()


@pytest.mark.slow
def test_progress_bar_counts_rounds_of_the_whole_run_after_resume(run, capsys):
    code = main(["--run_dir", str(run), "--ckpt_path", "last", "--model.num_rounds", "3",
                 "--trainer.enable_progress_bar", "true"])
    out = capsys.readouterr().out
    assert code == 0
    last = [part for part in out.replace("\r", "\n").splitlines() if "rounds" in part]
    assert last and "3/3" in last[-1], out[-500:]


@pytest.mark.slow
def test_summary_has_seed_and_wall_time_summed_over_sessions(run, capsys):
    first = json.loads((run / "summary.json").read_text())
    assert first["seed"] == 0 and first["wall_seconds"] > 0
    assert main(["--run_dir", str(run), "--ckpt_path", "last", "--model.num_rounds", "3"]) == 0, _errors(capsys)
    second = json.loads((run / "summary.json").read_text())
    assert second["seed"] == 0 and second["wall_seconds"] > first["wall_seconds"]


# ---- 4. divergence: the error line claims only what exists ----------------------------------------
def test_divergence_in_round_one_claims_only_what_the_run_directory_holds(tmp_path, capsys):
    run_dir = tmp_path / "run"
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("fedfdp").addHandler(handler)
    try:
        code = main(["--config", TINY, "--run_dir", str(run_dir), "--model.algorithm", "fedfdp.algorithms.FedAvg",
                     ALG + "privacy", "null",  # plain FedAvg: the FedFDP config's privacy would carry over
                     ALG + "lr", "1e38", "--trainer.callbacks", "[]", "--model.num_rounds", "5"])
    finally:
        logging.getLogger("fedfdp").removeHandler(handler)
    err = _errors(capsys)
    assert code == 3 and len(err) == 1 and "round 1" in err[0]  # exit status 3: diverged
    # no round was saved; the summary says how the run ended, and the log line what is kept ...
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["rounds_run"] == 0 and summary["final"] is None
    assert not (run_dir / "checkpoints").exists()
    kept = [m for m in records if "keeps" in m]
    assert kept and "no checkpoint" in kept[-1], records
    # ... and the error line (fedfdp.federation.DivergenceError) claims no kept files
    assert "kept" not in err[0], err[0]


# ---- 5. run directory creation, run_dir in config.yaml --------------------------------------------
@pytest.mark.parametrize("args", [["--data.init_args.num_clients", "500"], ["--model.clients_per_round", "9"],
                                  [PRIV + "sample_rate", "1.5"], ["--checkpoint_every", "0"]],
                         ids=["data", "federation", "algorithm", "checkpoint_every"])
def test_failed_start_leaves_no_run_directory(tmp_path, capsys, args):
    run_dir = tmp_path / "new" / "run"
    assert main(["--config", TINY, "--run_dir", str(run_dir), *args]) == 2
    assert len(_errors(capsys)) == 1
    assert not run_dir.exists()


@pytest.mark.slow
def test_config_yaml_records_the_default_run_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["--config", TINY, "--model.num_rounds", "1"]) == 0, _errors(capsys)
    (run_dir,) = (tmp_path / "runs" / "tiny_fedfdp").iterdir()
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["run_dir"] is not None and (Path(saved["run_dir"]).resolve() == run_dir.resolve())
    assert saved["ckpt_path"] is None


# ---- 6. one process per run directory ------------------------------------------------------------
HOLD = ("import sys, time; from pathlib import Path; from fedfdp.runlock import RunLock; "
        "lock = RunLock(Path(sys.argv[1])).acquire(); print('locked', flush=True); time.sleep(120)")


def _holder(run_dir: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.slow
def test_busy_run_directory_is_refused_naming_the_holder_and_a_killed_holder_does_not_block(tmp_path, capsys):
    run_dir = tmp_path / "run"
    proc = _holder(run_dir)
    try:
        before = _snapshot(run_dir)
        assert main(["--config", TINY, "--run_dir", str(run_dir), "--model.num_rounds", "1"]) == 2
        err = _errors(capsys)
        assert len(err) == 1 and str(run_dir) in err[0] and str(proc.pid) in err[0], err
        assert _snapshot(run_dir) == before
        # ranks > 0 started by Lightning's DDP launcher share rank 0's directory: they take no lock
        os.environ["LOCAL_RANK"] = "1"
        try:
            build_cli(["--config", TINY, "--run_dir", str(run_dir)])
        finally:
            del os.environ["LOCAL_RANK"]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (run_dir / "run.lock").exists()  # stale: its holder was SIGKILLed
    assert main(["--config", TINY, "--run_dir", str(run_dir), "--model.num_rounds", "1"]) == 0, _errors(capsys)
    assert not (run_dir / "run.lock").exists()  # released (and removed) when the run ends


# ---- 7. the privacy ledger lives in the run directory ---------------------------------------------
def test_rdp_accounting_gets_the_run_directory_ledger(tmp_path):
    from callbacks.accounting import RDPAccounting

    cli = build_cli(["--config", TINY, "--run_dir", str(tmp_path / "run")])
    (accountant,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, RDPAccounting)]
    assert accountant.ledger_path == str(tmp_path / "run" / "privacy_ledger.jsonl")


def test_config_differences_allow_list_class_changes_and_round_rule():
    from fedfdp.rundir import config_differences

    saved = {"seed_everything": 0, "wandb": "auto", "run_dir": "a",
             "model": {"num_rounds": 5, "algorithm": {"class_path": "A", "init_args": {"lr": 1.0, "q": 0.1}}},
             "trainer": {"log_every_n_steps": 1, "devices": 1, "callbacks": [{"class_path": "C", "init_args": {}}]},
             "data": {"class_path": "D", "init_args": {"data_dir": "x", "alpha": 1.0}}}
    harmless = {**saved, "wandb": "disabled", "run_dir": "b",
                "model": {**saved["model"], "num_rounds": 9},
                "trainer": {**saved["trainer"], "log_every_n_steps": 50},
                "data": {"class_path": "D", "init_args": {"data_dir": "y", "alpha": 1.0}}}
    assert config_differences(saved, harmless) == []
    assert config_differences(saved, {**saved, "model": {**saved["model"], "num_rounds": None}}) == []
    assert config_differences({**saved, "model": {**saved["model"], "num_rounds": None}}, saved) == [
        "model.num_rounds: saved null, new 5 (may only be raised on resume)"]
    other_class = {**saved, "model": {**saved["model"], "algorithm": {"class_path": "B", "init_args": {"lr": 2.0}}}}
    assert config_differences(saved, other_class) == ["model.algorithm.class_path: saved A, new B"]
    more_callbacks = {**saved, "trainer": {**saved["trainer"], "callbacks": [*saved["trainer"]["callbacks"],
                                                                              {"class_path": "E", "init_args": {}}]}}
    assert config_differences(saved, more_callbacks) == ["trainer.callbacks[1].class_path: saved <absent>, new E"]


# ---- 6. checkpoint cadence ------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("every", [None, 1])
def test_checkpoint_every_sets_how_many_rounds_a_killed_run_replays(tmp_path, capsys, every):
    """Round checkpoints follow ``--checkpoint_every`` (default ``model.eval_every``): with
    ``eval_every: 3`` a run killed after round 2 finds ``round-2.ckpt`` with ``--checkpoint_every 1``
    and no round checkpoint without it (it would replay, and charge again, rounds 1-2)."""
    run_dir = tmp_path / "run"
    args = ["--config", TINY, "--run_dir", str(run_dir), PRIV + "noise_multiplier", "2.0",
            "--model.eval_every", "3", "--model.num_rounds", "2"]
    assert main(args + (["--checkpoint_every", str(every)] if every else [])) == 0, _errors(capsys)
    rounds = sorted(p.name for p in (run_dir / "checkpoints").glob("round-*.ckpt"))
    assert rounds == (["round-2.ckpt"] if every == 1 else [])
