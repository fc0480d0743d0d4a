"""The sweep engine (fedfdp.sweep): runs trained together equal the same runs alone.

Tolerance per algorithm family: the batched pass sums in another order than a run's own stacked
pass, so final models agree to a relative L2 distance below 1e-4, the rounds and ε exactly, and
the final pooled accuracy to within one test record of 101 (0.01).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from fedfdp.experiments.__main__ import main as experiments
from fedfdp.fit import main as fit

CONFIGS = Path(__file__).parents[1] / "configs"
ALG = "--model.algorithm.init_args."


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _model(run_dir: Path) -> torch.Tensor:
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    return torch.cat([v.flatten() for k, v in sorted(state.items()) if k.startswith("global_model.")])


PRIVACY = [f"{ALG}privacy", "fedfdp.privacy.SampleLevelDP", f"{ALG}privacy.init_args.sample_rate", "0.2",
           f"{ALG}privacy.init_args.max_grad_norm", "1.0", f"{ALG}privacy.init_args.noise_multiplier", "1.0"]
FAMILIES = {
    "dpfedavg": ("tiny_dpfedavg.yaml", []),
    "fedfdp": ("tiny_fedfdp.yaml", []),
    "local-only-dp": ("tiny_dpfedavg.yaml", ["--model.algorithm", "fedfdp.algorithms.LocalOnly",
                                             f"{ALG}lr", "0.5", *PRIVACY]),
    "finetune": ("tiny_dpfedavg.yaml", ["--model.algorithm", "fedfdp.algorithms.DPFedAvgFineTune",
                                        f"{ALG}finetune_fraction", "0.5", f"{ALG}lr", "1.0", *PRIVACY]),
    "prior-correction": ("tiny_dpfedavg.yaml", ["--model.algorithm", "fedfdp.algorithms.DPFedAvgPriorCorrection",
                                                f"{ALG}prior_strength", "2.0", f"{ALG}lr", "1.0", *PRIVACY]),
    "adaptive-clipping": ("tiny_dpfedavg.yaml", ["--model.algorithm", "fedfdp.algorithms.DPFedAvgAdaClip",
                                                 f"{ALG}lr", "1.0", *PRIVACY]),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_sweep_run_equals_the_run_alone(tmp_path, family):
    config, extra = FAMILIES[family]
    rounds = ["--model.num_rounds", "4"]
    code = experiments(["sweep", "--config", str(CONFIGS / config), "--seeds", "0", "1", "--out",
                        str(tmp_path / "sweep"), "--fit-args", *rounds, *extra])
    assert code == 0
    index = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [(e["name"], e["status"]) for e in index] == [("seed0", 0), ("seed1", 0)]
    for seed in (0, 1):
        alone = tmp_path / f"alone{seed}"
        assert fit(["--config", str(CONFIGS / config), "--run_dir", str(alone), "--seed_everything", str(seed),
                    "--wandb", "disabled", *rounds, *extra]) == 0
        together = tmp_path / "sweep" / f"seed{seed}"
        a, b = _summary(alone), _summary(together)
        assert (a["status"], a["rounds_run"], a["epsilon"]) == (b["status"], b["rounds_run"], b["epsilon"])
        assert abs(a["final"]["accuracy"] - b["final"]["accuracy"]) <= 0.01
        ma, mb = _model(alone), _model(together)
        assert float((ma - mb).norm() / ma.norm()) < 1e-4
        assert sorted(p.name for p in together.iterdir()) == sorted(p.name for p in alone.iterdir())
        ledger = (together / "privacy_ledger.jsonl").read_text().splitlines()
        assert len(ledger) == len((alone / "privacy_ledger.jsonl").read_text().splitlines())


@pytest.mark.slow
def test_a_grid_names_its_runs_and_varies_their_values(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text("model.algorithm.init_args.lr: [0.5, 2.0]\n")
    out = tmp_path / "sweep"
    assert experiments(["sweep", "--config", str(CONFIGS / "tiny_dpfedavg.yaml"), "--seeds", "3", "--grid", str(grid),
                        "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert names == ["lr=0.5,seed3", "lr=2.0,seed3"]
    for name, lr in (("lr=0.5,seed3", 0.5), ("lr=2.0,seed3", 2.0)):
        config = (out / name / "config.yaml").read_text()
        assert f"lr: {lr}" in config and "seed_everything: 3" in config


def test_an_algorithm_the_engine_cannot_batch_is_refused_with_one_line(tmp_path, capsys):
    code = experiments(["sweep", "--config", str(CONFIGS / "tiny_dpscaffold.yaml"), "--seeds", "0", "1",
                        "--out", str(tmp_path / "sweep")])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1, errors
    assert "Scaffold has no one-step private update" in errors[0] and "cannot be batched" in errors[0]
    assert not any((tmp_path / "sweep").glob("seed*/summary.json"))  # nothing was fitted


def test_several_local_steps_are_refused_not_cut_to_one(tmp_path, capsys):
    """DP-FedAvg with K > 1 local steps stacks in lockstep in a run of its own, but the sweep's shared
    pass is one step a round: it refuses the run rather than taking one step of K."""
    code = experiments(["sweep", "--config", str(CONFIGS / "tiny_dpfedavg.yaml"), "--seeds", "0", "1",
                        "--out", str(tmp_path / "sweep"), "--fit-args", "--model.algorithm.init_args.privacy.init_args.local_steps", "2"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1, errors
    assert "local_steps=2" in errors[0] and "cannot be batched" in errors[0]
    assert not any((tmp_path / "sweep").glob("seed*/summary.json"))


class SignalAtRound(Callback):
    """Sends this process one SIGTERM at the end of round ``at`` of the first run to get there (a
    test's stand-in for a scheduler; a second signal would stop the sweep at once)."""

    sent = False

    def __init__(self, at: int = 2) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: D102
        if trainer.global_step == self.at and not SignalAtRound.sent:
            SignalAtRound.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_a_killed_sweep_resumes_every_run(tmp_path):
    config = str(CONFIGS / "tiny_fedfdp.yaml")
    rounds = ["--model.num_rounds", "5"]
    out = tmp_path / "sweep"
    stop = ["--trainer.callbacks+=tests.experiments.test_sweep.SignalAtRound", "--trainer.callbacks.at=2"]
    SignalAtRound.sent = False
    code = experiments(["sweep", "--config", config, "--seeds", "0", "1", "--out", str(out), "--fit-args", *rounds,
                        *stop])
    assert code == 128 + signal.SIGTERM
    for seed in (0, 1):
        summary = _summary(out / f"seed{seed}")
        assert summary["status"] == "interrupted" and summary["rounds_run"] < 5
        assert (out / f"seed{seed}" / "checkpoints" / "last.ckpt").exists()
    # the resume repeats the runs' arguments (a resume may not change a run); the signal was sent once
    assert experiments(["sweep", "--config", config, "--seeds", "0", "1", "--out", str(out), "--ckpt_path", "last",
                        "--fit-args", *rounds, *stop]) == 0
    straight = tmp_path / "straight"
    assert experiments(["sweep", "--config", config, "--seeds", "0", "1", "--out", str(straight), "--fit-args",
                        *rounds]) == 0
    for seed in (0, 1):
        resumed, whole = _summary(out / f"seed{seed}"), _summary(straight / f"seed{seed}")
        assert resumed["status"] == whole["status"] == "completed" and resumed["rounds_run"] == 5
        assert float((_model(out / f"seed{seed}") - _model(straight / f"seed{seed}")).norm()) < 1e-5
    # run again: every run has finished, nothing is fitted
    assert experiments(["sweep", "--config", config, "--seeds", "0", "1", "--out", str(out), "--ckpt_path", "last",
                        "--fit-args", *rounds, *stop]) == 0
