"""The command line: an end-to-end tiny run, --print_config, resume, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedfdp.fit import main
from tests.conftest import REPO

TINY = str(REPO / "tests" / "configs" / "tiny_fedfdp.yaml")


@pytest.mark.slow
def test_end_to_end_run_writes_summary_config_and_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([sys.executable, "-m", "fedfdp.fit", "--config", TINY, "--run_dir", str(run_dir)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "args parameter is intended" not in proc.stderr  # no LightningCLI warning on a plain command line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_run"] == 2 and summary["algorithm"] == "FedFDP"
    assert 0 < summary["epsilon"] <= 10.0
    assert len(summary["clients"]["accuracy"]) == 3
    for key in ("accuracy", "psi_paper", "psi_train_global", "accuracy_variance", "accuracy_worst", "accuracy_jain"):
        assert key in summary["final"]
    assert (run_dir / "config.yaml").exists() and (run_dir / "checkpoints" / "last.ckpt").exists()
    metrics = (run_dir / "metrics.csv").read_text().splitlines()
    assert "epsilon" in metrics[0] and "psi_code" in metrics[0] and "client_negative_fraction" in metrics[0]


def test_print_config_shows_the_resolved_config(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", TINY, "--print_config"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "class_path: fedfdp.algorithms.FedFDP" in out and "fairness_weight: 0.1" in out


@pytest.mark.slow
def test_resume_continues_and_existing_run_is_never_overwritten(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    assert main(["--config", TINY, "--run_dir", run_dir]) == 0
    assert main(["--config", TINY, "--run_dir", run_dir]) == 2  # refuses to overwrite
    assert "already holds" in capsys.readouterr().err
    assert main(["--config", TINY, "--run_dir", run_dir, "--ckpt_path", "last", "--model.num_rounds", "3"]) == 0
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    assert summary["rounds_run"] == 3
    assert [h["round"] for h in summary["history"]] == [1, 2, 3]


ALG = "--model.algorithm.init_args."
PRIV = ALG + "privacy.init_args."  # the privacy mechanism's (fedfdp.privacy.SampleLevelDP) options
BAD_INPUTS = [
    ([PRIV + "sample_rate", "1.5"], "algorithm.privacy.sample_rate must be in (0, 1]"),
    ([PRIV + "sample_rate", "0"], "algorithm.privacy.sample_rate must be in (0, 1]"),
    ([PRIV + "noise_multiplier", "-1"], "algorithm.privacy.noise_multiplier must be >= 0"),
    ([PRIV + "max_grad_norm", "0"], "algorithm.privacy.max_grad_norm must be finite and > 0"),
    ([ALG + "fairness_weight", "-0.1"], "algorithm.fairness_weight must be >= 0"),
    ([ALG + "fair_clip_mode", "wild"], "fair_clip_mode"),
    (["--model.algorithm", "fedfdp.algorithms.Nope"], "fedfdp.algorithms.FedFDP"),
    (["--model.num_rounds", "-3"], "model.num_rounds must be >= 1"),
    (["--data.init_args.num_clients", "500"], "data.min_size"),
    (["--data", "datamodules.FashionMNISTDataModule", "--data.init_args.data_dir", "/nonexistent"],
     "data.data_dir"),
    (["--model.bogus", "3"], "unrecognized arguments"),
]


@pytest.mark.parametrize("args, expected", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_gives_one_clear_error_line(tmp_path, capsys, args, expected):
    code = main(["--config", TINY, "--run_dir", str(tmp_path / "run"), *args])
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2
    assert len(err_lines) == 1 and expected in err_lines[0], err_lines
    assert not (tmp_path / "run" / "summary.json").exists()
