"""The one experiment runner (:mod:`fedfdp.experiments.runner`) and its results (:mod:`fedfdp.experiments.results`):
skip finished runs, resume interrupted ones, move aside runs without a checkpoint, collect, tabulate."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from fedfdp.experiments import stop_signals
from fedfdp.experiments.results import (
    finished_summary, format_mean_std, group_rows, is_finished, mean_std, read_metrics, read_summary,
    recorded_wall_seconds,
)
from fedfdp.experiments.runner import Runner, RunSpec, last_error_line
from fedfdp.fit import main as fit_main
from tests.conftest import REPO, saved_run

TINY = REPO / "tests" / "configs" / "tiny_dpfedavg.yaml"


def _summary(run_dir, status="completed", rounds=2, planned=2, **extra):
    run_dir.mkdir(parents=True, exist_ok=True)
    payload = {"rounds_run": rounds, "rounds_planned": planned, **extra}
    if status is not None:
        payload["status"] = status
    (run_dir / "summary.json").write_text(json.dumps(payload))


def _no_config():
    raise AssertionError("the config of a finished run was written again")


@pytest.fixture
def no_launch(monkeypatch):
    monkeypatch.setattr(stop_signals, "launch", lambda *a, **k: (_ for _ in ()).throw(AssertionError("launched")))


class FakeFit:
    """Stands in for :func:`fedfdp.experiments.stop_signals.launch`: records each launch, writes ``output``
    to the log, exits ``code``;
    with ``start`` it writes the run directory's ``config.yaml`` (the fit started), with ``finish`` a summary."""

    def __init__(self, code=0, output="", finish=False, start=False):
        self.code, self.output, self.finish, self.start, self.calls = code, output, finish, start, []

    def __call__(self, cmd, stdout, stderr, env):
        self.calls.append((cmd, env))
        stdout.write(self.output)
        run_dir = Path(cmd[cmd.index("--run_dir") + 1])
        if self.start:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(f"started {len(self.calls)}\n")
        if self.finish:
            _summary(run_dir, rounds=2, planned=2)
        return self.code


@pytest.mark.parametrize("status, rounds, planned, finished", [
    ("completed", 2, 2, True), ("budget_spent", 3, 3, True), ("completed", 1, 2, False), ("running", 2, 2, False),
    ("interrupted", 1, 2, False), ("failed", 1, 2, False), ("diverged", 1, 2, False), (None, 2, 2, True),
    (None, 1, 2, False)])
def test_a_run_is_finished_when_its_status_and_rounds_say_so(tmp_path, status, rounds, planned, finished):
    _summary(tmp_path, status, rounds, planned)
    assert is_finished(read_summary(tmp_path)) is finished
    assert (finished_summary(tmp_path) is not None) is finished


def test_finished_runs_are_skipped_without_a_launch_or_a_config(tmp_path, no_launch):
    specs = [RunSpec(run_dir=tmp_path / name, config=tmp_path / f"{name}.yaml", make_config=_no_config)
             for name in ("completed", "budget", "interrupted", "new")]
    _summary(specs[0].run_dir, "completed")
    _summary(specs[1].run_dir, "budget_spent", rounds=7, planned=7)
    _summary(specs[2].run_dir, "interrupted", rounds=1, planned=2)
    runner = Runner()
    assert runner.pending(specs) == specs[2:]
    for spec in specs[:2]:
        result = runner.run(spec)
        assert result.status == "skipped" and result.finished and result.wall_seconds == 0.0
        assert not (spec.run_dir / "harness.json").exists() and not spec.config.exists()


def test_a_finished_run_of_another_configuration_is_refused_not_skipped(tmp_path, no_launch, caplog):
    """A finished run is skipped only when it trained what the spec asks for: a changed override on
    the same --out (here the lr) used to be skipped as finished and tabulated with the old run's
    numbers. Now it is refused with one error line naming the difference, not launched, not changed,
    and its summary is not handed back to be tabulated."""
    run = saved_run(tmp_path, TINY, "--model.algorithm.init_args.lr", "0.5", name="seed0")
    _summary(run, "completed")
    (run / "harness.json").write_text(json.dumps({"command": ["fit"], "returncode": 0, "wall_seconds": 7.5}))
    before = {f: f.read_bytes() for f in run.iterdir()}
    runner = Runner()
    same = RunSpec(run, TINY, seed=0, args=("--model.algorithm.init_args.lr", "0.5"))
    assert runner.run(same).status == "skipped" and runner.run(same).wall_seconds == 7.5  # the recorded wall time
    for args, seed, named in [(("--model.algorithm.init_args.lr", "0.25"), 0, "model.algorithm.init_args.lr"),
                              ((), 0, "model.algorithm.init_args.lr"),  # the config's own lr 1.0
                              (("--model.algorithm.init_args.lr", "0.5"), 1, "seed_everything")]:
        caplog.clear()
        with caplog.at_level("ERROR", logger="fedfdp.experiments.runner"):
            result = runner.run(RunSpec(run, TINY, seed=seed, args=args))
        assert (result.status, result.returncode, result.summary) == ("failed", 2, None)
        (line,) = caplog.messages
        assert result.error_line == line  # what a harness reports for it
        assert line.startswith(f"error: {run} holds a run of another configuration") and f"{named}: the run" in line
        caplog.clear()
        with caplog.at_level("ERROR", logger="fedfdp.experiments.runner"):
            assert runner.pending([RunSpec(run, TINY, seed=seed, args=args)]) == []  # a dry run says so too
        assert caplog.messages == [line]
    assert {f: f.read_bytes() for f in run.iterdir()} == before


def test_command_seeds_nices_checkpoints_every_round_and_resumes_from_the_last_checkpoint(tmp_path):
    """A harness run checkpoints every round (a kill then replays, and charges again, at most the
    round it cut) unless its arguments choose otherwise, in either spelling."""
    spec = RunSpec(run_dir=tmp_path / "run", config=tmp_path / "c.yaml", seed=3, args=("--a", "b"))
    fit = [sys.executable, "-m", "fedfdp.fit", "--config", str(spec.config), "--run_dir", str(spec.run_dir)]
    every_round = ["--checkpoint_every", "1"]
    assert Runner().command(spec) == [*fit, "--seed_everything", "3", "--a", "b", *every_round]
    assert Runner(niceness=7).command(RunSpec(spec.run_dir, spec.config)) == ["nice", "-n", "7", *fit, *every_round]
    for chosen in (("--checkpoint_every", "5"), ("--checkpoint_every=5",)):
        cmd = Runner().command(RunSpec(spec.run_dir, spec.config, args=chosen))
        assert cmd[-len(chosen):] == list(chosen) and cmd.count("1") == 0
    (spec.run_dir / "checkpoints").mkdir(parents=True)
    (spec.run_dir / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert Runner().command(spec)[-6:] == ["--a", "b", *every_round, "--ckpt_path", "last"]


def test_a_launch_writes_its_config_log_and_harness_and_reports_failure(tmp_path, monkeypatch):
    fake = FakeFit(code=3, output="starting\nerror: boom\nTraceback tail\n", start=True)
    monkeypatch.setattr(stop_signals, "launch", fake)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("WANDB_MODE", "online")
    spec = RunSpec(run_dir=tmp_path / "runs" / "a", config=tmp_path / "configs" / "a.yaml", seed=1,
                   make_config=lambda: {"model": {"num_rounds": 2}})
    runner = Runner(env={"WANDB_MODE": "disabled"}, env_defaults={"OMP_WAIT_POLICY": "PASSIVE", "X_DEFAULT": "1"})
    result = runner.run(spec)
    assert result.status == "failed" and result.returncode == 3 and not result.finished
    assert yaml.safe_load(spec.config.read_text()) == {"model": {"num_rounds": 2}}
    (cmd, env), = fake.calls
    assert env["WANDB_MODE"] == "disabled" and env["OMP_WAIT_POLICY"] == "ACTIVE" and env["X_DEFAULT"] == "1"
    harness = json.loads((spec.run_dir / "harness.json").read_text())
    assert harness["command"] == cmd and harness["returncode"] == 3 and harness["wall_seconds"] >= 0
    assert recorded_wall_seconds(spec.run_dir) == harness["wall_seconds"]
    assert last_error_line(result.log) == "error: boom"
    runner.run(spec)  # the log is appended to, not replaced
    assert result.log.read_text().count("starting") == 2


def test_results_without_a_checkpoint_are_moved_aside_and_the_run_starts_again(tmp_path, monkeypatch):
    fake = FakeFit(finish=True)
    monkeypatch.setattr(stop_signals, "launch", fake)
    run_dir = tmp_path / "seed0"
    _summary(run_dir, "interrupted", rounds=1, planned=2)
    result = Runner().run(RunSpec(run_dir=run_dir, config=TINY))
    (stale,) = tmp_path.glob("seed0.stale-*")
    assert read_summary(stale)["status"] == "interrupted"
    (cmd, _), = fake.calls
    assert "--ckpt_path" not in cmd and result.status == "ran" and result.finished


def test_run_all_keeps_the_order_and_launches_nothing_after_the_caller_stops(tmp_path, monkeypatch):
    fake = FakeFit(finish=True)
    monkeypatch.setattr(stop_signals, "launch", fake)
    specs = [RunSpec(run_dir=tmp_path / f"r{k}", config=TINY) for k in range(4)]
    results = Runner().run_all(specs)
    assert next(results).spec == specs[0]
    results.close()
    assert len(fake.calls) == 1
    results = list(Runner().run_all(specs, jobs=2))
    assert [r.spec for r in results] == specs
    assert [r.status for r in results] == ["skipped", "ran", "ran", "ran"] and len(fake.calls) == 4


@pytest.mark.slow
def test_interrupted_run_resumes_from_its_checkpoint_to_the_end(tmp_path):
    """A real run stopped after round 1 of 2 is resumed with --ckpt_path last, then skipped."""
    run_dir = tmp_path / "run"
    assert fit_main(["--config", str(TINY), "--run_dir", str(run_dir), "--model.num_rounds", "1",
                     "--wandb", "disabled"]) == 0
    summary = read_summary(run_dir)
    summary.update(status="interrupted", rounds_planned=2)  # as a 2-round run stopped after round 1 leaves it
    (run_dir / "summary.json").write_text(json.dumps(summary))
    spec = RunSpec(run_dir=run_dir, config=TINY, args=("--model.num_rounds", "2", "--wandb", "disabled"))
    runner = Runner(env={"WANDB_MODE": "disabled"})
    result = runner.run(spec)
    assert result.status == "ran", result.log.read_text()[-2000:]
    assert result.finished and result.summary["rounds_run"] == 2 and result.summary["status"] == "completed"
    assert [h["round"] for h in result.summary["history"]] == [1, 2]  # round 1 came from the checkpoint
    assert json.loads((run_dir / "harness.json").read_text())["command"][-2:] == ["--ckpt_path", "last"]
    metrics = read_metrics(run_dir)
    assert metrics and any(row.get("accuracy") for row in metrics)
    assert runner.run(spec).status == "skipped"


def test_collection_tolerates_missing_and_broken_files(tmp_path):
    assert read_summary(tmp_path) is None and read_metrics(tmp_path) == [] and recorded_wall_seconds(tmp_path) is None
    (tmp_path / "summary.json").write_text("{not json")
    (tmp_path / "harness.json").write_text("{}")
    assert read_summary(tmp_path) is None and recorded_wall_seconds(tmp_path) is None
    (tmp_path / "metrics.csv").write_text("round,accuracy\n1,0.5\n2,0.75\n")
    assert read_metrics(tmp_path) == [{"round": "1", "accuracy": "0.5"}, {"round": "2", "accuracy": "0.75"}]


def test_mean_std_over_seeds_and_its_formatting():
    mean, std = mean_std([80.0, 90.0])
    assert mean == 85.0 and std == pytest.approx(7.0710678)  # sample std
    assert mean_std([80.0, 90.0], ddof=0) == (85.0, 5.0)  # population std
    assert mean_std([3.0]) == (3.0, 0.0)
    two = lambda v: f"{v:.2f}"  # noqa: E731
    assert format_mean_std([80.0, 90.0], two) == "85.00±7.07"
    assert format_mean_std([80.0], two) == "80.00"
    assert format_mean_std([], two) == "—" and format_mean_std([], two, empty="–") == "–"
    rows = [{"m": "b", "s": 0}, {"m": "a", "s": 0}, {"m": "b", "s": 1}]
    assert list(group_rows(rows, "m")) == [("b",), ("a",)]
    assert group_rows(rows, "m")[("b",)] == [rows[0], rows[2]]


def test_the_commands_report_a_failed_run_in_one_error_line(tmp_path, monkeypatch, capsys):
    """rcdpfl-table goes on after a failed run (exit 1); finp-table stops at the first (its exit status)."""
    from fedfdp.experiments.__main__ import main

    monkeypatch.chdir(REPO)
    fake = FakeFit(code=2, output="loading\nerror: data not found\n")
    monkeypatch.setattr(stop_signals, "launch", fake)
    assert main(["rcdpfl-table", "--methods", "rcdpfl", "--seeds", "0", "1", "--out", str(tmp_path / "rc")]) == 1
    # only the error lines: log lines of earlier tests' handlers may share stderr in a full run
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(fake.calls) == 2 and len(errors) == 2
    assert all(e.startswith("error: digits_rcdpfl_eps5_s") and "error: data not found" in e for e in errors)
    assert (tmp_path / "rc" / "configs" / "digits_rcdpfl_eps5_s1.yaml").exists()
    assert main(["finp-table", "--rows", "baseline", "finp_pca", "--seeds", "0", "--out", str(tmp_path / "f")]) == 2
    (error,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    log = Path(error.rsplit("(see ", 1)[1].rstrip(")"))  # the fit did not start: its output is kept outside
    assert error.startswith("error: finp-table: ") and "error: data not found" in error
    assert not log.is_relative_to(tmp_path / "f") and "error: data not found" in log.read_text()
    assert not (tmp_path / "f" / "baseline" / "seed0").exists()
    assert len(fake.calls) == 3
