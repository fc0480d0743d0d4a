"""Reliability: crash-safe resume after SIGKILL, budget guard on resume, divergence, secure noise, reports."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from callbacks import NoisyLossReporting, RDPAccounting
from fedfdp import FedFDP
from fedfdp.fit import main
from fedfdp.privacy import SampleLevelDP
from fedfdp.report import main as report_main
from fedfdp.seeding import SecureGenerator
from tests.conftest import REPO
from tests.helpers import flat, run_federation
from tests.cli.test_cli import TINY

ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_WAIT_POLICY": "PASSIVE"}


def dp() -> dict:
    """lr 1.0 and sample-level DP (a fresh mechanism for each algorithm)."""
    return dict(lr=1.0, privacy=SampleLevelDP(sample_rate=0.2, max_grad_norm=0.5, noise_multiplier=1.0))


def _fit_cmd(run_dir, *extra):
    return [sys.executable, "-m", "fedfdp.fit", "--config", TINY, "--run_dir", str(run_dir),
            "--model.eval_every", "1", "--trainer.callbacks.init_args.target_epsilon", "1000",
            "--trainer.callbacks+=callbacks.RunSummary", "--trainer.callbacks.report", "false", *extra]


def _final_state(run_dir):
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    model = {k: v for k, v in ckpt["state_dict"].items() if k.startswith("global_model.")}
    callbacks = {k: v for k, v in ckpt["callbacks"].items() if "RDPAccounting" in k or "NoisyLoss" in k}
    return ckpt["global_step"], model, callbacks, ckpt["fedfdp"]


@pytest.mark.slow
def test_sigkill_at_a_random_round_then_resume_equals_uninterrupted_run(tmp_path):
    rounds = "200"  # long enough that the kill lands mid-run even on an idle machine
    straight = tmp_path / "straight"
    subprocess.run(_fit_cmd(straight, "--model.num_rounds", rounds), cwd=REPO, env=ENV, check=True,
                   capture_output=True, timeout=300)

    crashed = tmp_path / "crashed"
    proc = subprocess.Popen(_fit_cmd(crashed, "--model.num_rounds", rounds), cwd=REPO, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not (crashed / "checkpoints" / "last.ckpt").exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(random.Random(os.getpid()).uniform(0.0, 0.5))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at, *_ = _final_state(crashed)
    assert 1 <= killed_at < int(rounds), f"the kill did not land mid-run (round {killed_at})"

    subprocess.run(_fit_cmd(crashed, "--model.num_rounds", rounds, "--ckpt_path", "last"), cwd=REPO, env=ENV,
                   check=True, capture_output=True, timeout=300)
    step_a, model_a, callbacks_a, algo_a = _final_state(straight)
    step_b, model_b, callbacks_b, algo_b = _final_state(crashed)
    assert step_a == step_b == int(rounds)
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a)
    loss_state = {k: v for k, v in callbacks_a.items() if "NoisyLoss" in k}
    assert loss_state == {k: v for k, v in callbacks_b.items() if "NoisyLoss" in k} and algo_a == algo_b
    summary_a = json.loads((straight / "summary.json").read_text())
    summary_b = json.loads((crashed / "summary.json").read_text())
    # the rounds after the last checkpoint were released twice: the ledger charges both
    assert summary_b["epsilon"] >= summary_a["epsilon"]
    assert summary_a["final"] == summary_b["final"]


@pytest.mark.slow
def test_resuming_a_run_that_spent_its_budget_is_refused(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    budget = ["--trainer.callbacks.init_args.target_epsilon", "3.0", "--model.num_rounds", "null"]
    assert main(["--config", TINY, "--run_dir", run_dir, *budget]) == 0
    spent = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert spent["epsilon"] <= 3.0
    assert main(["--config", TINY, "--run_dir", run_dir, "--ckpt_path", "last", *budget]) == 2
    err = capsys.readouterr().err
    assert "nothing left to train" in err
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == spent


def test_divergence_stops_with_round_and_client(tmp_path, capsys):
    code = main(["--config", TINY, "--run_dir", str(tmp_path / "run"),
                 "--model.algorithm", "fedfdp.algorithms.FedAvg", "--model.algorithm.init_args.privacy", "null",
                 "--model.algorithm.init_args.lr", "1e38",
                 "--trainer.callbacks", "[]", "--model.num_rounds", "5"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 3 and len(err) == 1  # exit status 3: diverged
    assert "round" in err[0] and "client" in err[0] and "non-finite" in err[0]


def test_secure_generator_draws_standard_normals_and_runs_differ():
    gen = SecureGenerator()
    z = gen.normal((200_000,), torch.float64)
    assert abs(z.mean().item()) < 0.02 and abs(z.std().item() - 1.0) < 0.01
    u = gen.uniform(10_000)
    assert (u > 0).all() and (u <= 1).all()
    a, _ = run_federation(FedFDP(**dp()), [NoisyLossReporting(), RDPAccounting()], rounds=1, secure_rng=True)
    b, _ = run_federation(FedFDP(**dp()), [NoisyLossReporting(), RDPAccounting()], rounds=1, secure_rng=True)
    assert not torch.equal(flat(a.global_model), flat(b.global_model))


@pytest.mark.slow
def test_report_and_comparison_are_written(tmp_path):
    runs = []
    for name, lam in (("a", "0.0"), ("b", "1.0")):
        run_dir = tmp_path / name
        assert main(["--config", TINY, "--run_dir", str(run_dir), "--model.num_rounds", "3",
                     "--model.algorithm.init_args.fairness_weight", lam]) == 0
        runs.append(run_dir)
        report = (run_dir / "report.md").read_text()
        assert "Pooled test accuracy" in report and "plots/clients.png" in report
        assert (run_dir / "plots" / "clients.png").stat().st_size > 1000
        assert (run_dir / "plots" / "clip_factors.png").exists()
    assert report_main([str(r) for r in runs] + ["--out", str(tmp_path / "cmp")]) == 0
    comparison = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "| a |" in comparison
    # the comparison names what differs (and nothing else: the run directories are not settings)
    assert "| `model.algorithm.init_args.fairness_weight` | 0 | 1 |" in comparison, comparison
    assert comparison.count("| `") == 1
    assert (tmp_path / "cmp" / "accuracy.png").exists()
    assert report_main([str(tmp_path / "nothing")]) == 2
