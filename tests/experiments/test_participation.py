"""A run with clients left out says so: the record, the status, the report, and what the harnesses make of it.

No process and no training: summaries are written by hand (the deployments that produce them are
tested in tests/flower/test_flower.py and tests/flower/test_flower_deployment.py).
"""

from __future__ import annotations

import json
import runpy

import pytest

from fedfdp.experiments import stop_signals
from fedfdp.experiments.results import ended_with_missing_clients, finished_summary, is_finished, read_summary
from fedfdp.experiments.runner import Runner, RunSpec
from fedfdp.participation import Participation, compact_rounds, coverage_note, final_status, has_missing_clients
from fedfdp.report import write_report
from tests.conftest import REPO


def test_participation_keeps_who_was_left_out_of_which_round_and_why():
    record = Participation()
    assert record.record(1, [0, 1, 2], [0, 1, 2]) == {} and not record
    assert record.record(4, [0, 1, 2], [0, 2]) == {1: "missing"}
    record.record(5, [0, 1, 2], [0], refused=[2])
    record.record(6, [0, 2], [0, 2])  # client 1 not sampled: not left out
    assert record.left_out() == {1: [4, 5], 2: [5]} and record.left_out("refused") == {2: [5]}
    copy = Participation()
    copy.load_state_dict(json.loads(json.dumps(record.state_dict())))
    assert copy.left_out() == record.left_out()
    copy.record(5, [0, 1, 2], [0, 1, 2])  # a round replayed after a resume replaces its record
    assert copy.left_out() == {1: [4]}
    copy.forget_from(4)
    assert not copy


@pytest.mark.parametrize("rounds, text", [([], "none"), ([3], "3"), ([4, 5, 6, 7, 8], "4-8"),
                                          ([8, 4, 5, 10, 6], "4-6, 8, 10")])
def test_compact_rounds(rounds, text):
    assert compact_rounds(rounds) == text


@pytest.mark.parametrize("status, left_out, evaluated, expected", [
    ("completed", {}, [0, 1, 2], "completed"),
    ("completed", {1: [4]}, [0, 1, 2], "completed_with_missing_clients"),
    ("budget_spent", {}, [0, 2], "budget_spent_with_missing_clients"),  # the final figures miss client 1
    ("completed", {}, None, "completed"),
    ("interrupted", {1: [4]}, [0, 2], "interrupted"), ("failed", {1: [4]}, [0], "failed"),
    ("running", {1: [4]}, [0], "running")])
def test_a_finished_run_with_clients_left_out_is_not_plain_completed(status, left_out, evaluated, expected):
    assert final_status(status, left_out, evaluated, 3) == expected


def _summary(run_dir, **extra):
    run_dir.mkdir(parents=True, exist_ok=True)
    payload = {"status": "completed", "rounds_run": 8, "rounds_planned": 8, "num_clients": 3,
               "evaluated_clients": [0, 1, 2], "missing_clients": {}, "refused_clients": {}, **extra}
    (run_dir / "summary.json").write_text(json.dumps(payload))
    return payload


LEFT_OUT = {"status": "completed_with_missing_clients", "missing_clients": {"1": [4, 5, 6, 7, 8]}}


@pytest.mark.parametrize("extra, missing", [
    ({}, False), (LEFT_OUT, True), ({"status": "budget_spent_with_missing_clients"}, True),
    ({"evaluated_clients": [0, 2]}, True),  # a summary that says completed but covers 2 of 3 clients
    ({"missing_clients": {"1": [4]}}, True)])
def test_harnesses_neither_tabulate_nor_rerun_a_run_with_clients_left_out(tmp_path, monkeypatch, extra, missing):
    summary = _summary(tmp_path / "run", **extra)
    assert has_missing_clients(summary) is missing
    assert is_finished(read_summary(tmp_path / "run")) is not missing
    assert (finished_summary(tmp_path / "run") is None) is missing
    assert ended_with_missing_clients(summary) is missing
    complete = runpy.run_path(str(REPO / "docs" / "complete_runs" / "tabulate.py"))["complete"]
    assert complete(summary) is not missing
    monkeypatch.setattr(stop_signals, "launch", lambda *a, **k: (_ for _ in ()).throw(AssertionError("launched")))
    spec = RunSpec(run_dir=tmp_path / "run", config=tmp_path / "c.yaml")
    result = Runner().run(spec)
    assert result.status == ("incomplete" if missing else "skipped") and result.finished is not missing
    assert Runner().pending([spec]) == []  # finished, or with clients left out: nothing to run (nor to list)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["summary.json"]


def test_report_says_in_its_first_lines_which_clients_were_left_out_and_what_the_figures_cover(tmp_path):
    final = {"accuracy": 0.30, "psi_paper": 0.1, "psi": 0.1, "accuracy_mean": 0.3, "accuracy_std": 0.1,
             "accuracy_worst": 0.2, "accuracy_worst10": 0.2, "accuracy_jain": 0.9}
    summary = _summary(tmp_path, algorithm="DPScaffold", final=final, best_accuracy=0.3, best_accuracy_round=8,
                       history=[{"round": 8, **final, "evaluated_clients": [0, 2]}],
                       clients={"accuracy": [0.3, float("nan"), 0.3], "loss": [1.0, float("nan"), 1.0],
                                "train_size": [10, 10, 10]},
                       peak_memory_mb=1.0, status="completed_with_missing_clients", evaluated_clients=[0, 2],
                       missing_clients={"1": [4, 5, 6, 7, 8], "2": [6]}, refused_clients={"2": [6]})
    lines = write_report(tmp_path).read_text().splitlines()
    assert "status **completed_with_missing_clients**" in lines[2]
    assert lines[4] == "**Not a complete run: clients were left out.**"
    assert lines[6] == ("- client 1 left out of rounds 4-8 (no upload: its node was lost, failed or did not "
                        "answer)")
    assert lines[7] == "- client 2 left out of round 6 (refused on its own privacy budget)"
    assert "cover clients 0, 2 (2 of 3); client 1 did not answer the evaluation" in lines[8]
    assert any(line.startswith("| pooled test accuracy (final, clients 0, 2 of 3) | 0.3000") for line in lines)
    assert any(line.startswith("| best pooled accuracy (round, clients 0, 2 of 3) |") for line in lines)
    assert coverage_note({**summary, "missing_clients": {}, "evaluated_clients": [0, 1, 2]}) == []
