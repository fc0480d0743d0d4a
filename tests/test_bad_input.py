"""Table-driven malformed inputs through the command line.

Each case must give exactly one ``error:`` line naming what is wrong and what is accepted, exit
with status 2, and leave an earlier run's results in the same run directory untouched.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedfdp.fit import main
from tests.test_cli import TINY
from tests.test_datamodules import write_dataset

ALG = "--model.algorithm.init_args."
FMNIST = ["--data", "datamodules.FashionMNISTDataModule", "--data.init_args.verify", "false",
          "--data.init_args.num_clients", "3", "--model.client.init_args.net.init_args.in_features", "784"]


def _idx_dir(tmp: Path, kind: str) -> Path:
    """Tiny FashionMNIST-format folders with one defect each."""
    folder = tmp / f"data_{kind}"
    if kind == "good":
        write_dataset(folder)
    elif kind == "truncated":
        paths = write_dataset(folder)
        path = paths["train_images"]
        path.write_bytes(path.read_bytes()[:-100])
    elif kind == "bad_magic":
        paths = write_dataset(folder)
        path = paths["train_labels"]
        path.write_bytes(b"\xff\xff\x08\x01" + path.read_bytes()[4:])
    elif kind == "shape":
        write_dataset(folder, shape=(20, 20))
    elif kind == "labels":
        write_dataset(folder, max_label=12)
    return folder


CASES = [  # (id, extra args or callable(tmp) -> args, expected fragment of the error line)
    ("unknown key", ["--model.bogus", "3"], "unrecognized arguments"),
    ("wrong type rounds", ["--model.num_rounds", "abc"], "model.num_rounds"),
    ("wrong type lr", [ALG + "lr", "fast"], "lr"),
    ("q above 1", [ALG + "sample_rate", "1.5"], "algorithm.sample_rate must be in (0, 1]"),
    ("q zero", [ALG + "sample_rate", "0"], "algorithm.sample_rate must be in (0, 1]"),
    ("sigma negative", [ALG + "noise_multiplier", "-1"], "algorithm.noise_multiplier must be >= 0"),
    ("C zero", [ALG + "max_grad_norm", "0"], "algorithm.max_grad_norm must be > 0"),
    ("lambda negative", [ALG + "fairness_weight", "-0.1"], "algorithm.fairness_weight must be >= 0"),
    ("bad clip mode", [ALG + "fair_clip_mode", "wild"], "fair_clip_mode"),
    ("bad normalisation", [ALG + "normalize_by", "median"], "normalize_by"),
    ("delta >= 1", ["--trainer.callbacks.init_args.delta", "1.5"], "RDPAccounting.delta must be in (0, 1)"),
    ("target eps negative", ["--trainer.callbacks.init_args.target_epsilon", "-1"], "target_epsilon"),
    ("bad initial loss", [ALG + "initial_broadcast_loss", "huge"], "initial_broadcast_loss"),
    ("negative rounds", ["--model.num_rounds", "-3"], "model.num_rounds must be >= 1"),
    ("eval_every zero", ["--model.eval_every", "0"], "model.eval_every must be >= 1"),
    ("too many sampled clients", ["--model.clients_per_round", "9"], "model.clients_per_round must be <="),
    ("unknown algorithm", ["--model.algorithm", "fedfdp.algorithms.Nope"], "fedfdp.algorithms.FedFDP"),
    ("unknown callback", ["--trainer.callbacks+=callbacks.Nope"], "trainer.callbacks"),
    ("unknown datamodule", ["--data", "datamodules.Nope"], "data"),
    ("alpha zero", ["--data.init_args.alpha", "0"], "data.alpha must be"),
    ("zero clients", ["--data.init_args.num_clients", "0"], "data.num_clients must be"),
    ("more clients than samples", ["--data.init_args.num_clients", "500"], "data.min_size"),
    ("train fraction 1.5", ["--data.init_args.train_fraction", "1.5"], "data.train_fraction"),
    ("missing data dir", ["--data", "datamodules.FashionMNISTDataModule", "--data.init_args.data_dir",
                          "/nonexistent"], "data.data_dir"),
    ("truncated IDX", lambda tmp: [*FMNIST, "--data.init_args.data_dir", str(_idx_dir(tmp, "truncated"))],
     "train-images-idx3-ubyte"),
    ("corrupted IDX magic", lambda tmp: [*FMNIST, "--data.init_args.data_dir", str(_idx_dir(tmp, "bad_magic"))],
     "train-labels-idx1-ubyte"),
    ("wrong image shape", lambda tmp: [*FMNIST, "--data.init_args.data_dir", str(_idx_dir(tmp, "shape"))],
     "28"),
    ("labels out of range", lambda tmp: [*FMNIST, "--data.init_args.data_dir", str(_idx_dir(tmp, "labels"))],
     "label"),
    ("unwritable run dir", lambda tmp: ["--run_dir", "/proc/fedfdp-run"], "not writable"),
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """An earlier run whose results must survive every bad invocation in the same run directory."""
    run_dir = tmp_path_factory.mktemp("earlier") / "run"
    assert main(["--config", TINY, "--run_dir", str(run_dir), "--model.num_rounds", "1"]) == 0
    return run_dir, (run_dir / "summary.json").read_bytes()


@pytest.mark.parametrize("args, expected", [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_input_one_line_exit_2_nothing_overwritten(tmp_path, capsys, finished_run, args, expected):
    run_dir, summary = finished_run
    extra = args(tmp_path) if callable(args) else args
    argv = ["--config", TINY, "--run_dir", str(run_dir), "--ckpt_path", "last", *extra]
    code = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2
    assert len(err) == 1 and expected in err[0], err
    assert (run_dir / "summary.json").read_bytes() == summary


def test_there_are_at_least_twenty_cases():
    assert len(CASES) >= 20
