"""Table-driven malformed inputs through the command line.

Each case must give exactly one ``error:`` line naming what is wrong and what is accepted, exit
with status 2, and leave an earlier run's results in the same run directory untouched.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedfdp.fit import main
from tests.cli.test_cli import TINY
from tests.idx_files import write_dataset

ALG = "--model.algorithm.init_args."
PRIV = ALG + "privacy.init_args."  # the privacy mechanism's (fedfdp.privacy.SampleLevelDP) options
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


def _config(tmp: Path, name: str, text: str) -> list[str]:
    """``--config <tmp>/<name>`` holding ``text`` (read after the tiny config, so it must be valid too)."""
    path = tmp / name
    path.write_text(text)
    return ["--config", str(path)]


def _har_with_nan(tmp: Path) -> list[str]:
    """UCI HAR files in which one reading of one window is ``nan``."""
    from tests.datamodules.test_har import write_uci_har

    write_uci_har(tmp, {"train": [1, 3], "test": [2]})
    signal = tmp / "UCI HAR Dataset" / "train" / "Inertial Signals" / "body_acc_y_train.txt"
    rows = signal.read_text().splitlines()
    rows[3] = " nan " + rows[3].split(maxsplit=1)[1]
    signal.write_text("\n".join(rows) + "\n")
    return ["--data", "datamodules.HARDataModule", "--data.init_args.data_dir", str(tmp),
            "--data.init_args.num_clients", "3"]


CASES = [  # (id, extra args or callable(tmp) -> args, expected fragment of the error line)
    ("unknown key", ["--model.bogus", "3"], "unrecognized arguments"),
    ("wrong type rounds", ["--model.num_rounds", "abc"], "model.num_rounds"),
    ("wrong type lr", [ALG + "lr", "fast"], "lr"),
    ("q above 1", [PRIV + "sample_rate", "1.5"], "algorithm.privacy.sample_rate must be in (0, 1]"),
    ("q zero", [PRIV + "sample_rate", "0"], "algorithm.privacy.sample_rate must be in (0, 1]"),
    ("sigma negative", [PRIV + "noise_multiplier", "-1"], "algorithm.privacy.noise_multiplier must be >= 0"),
    ("C zero", [PRIV + "max_grad_norm", "0"], "algorithm.privacy.max_grad_norm must be finite and > 0"),
    ("lambda negative", [ALG + "fairness_weight", "-0.1"], "algorithm.fairness_weight must be >= 0"),
    ("bad clip mode", [ALG + "fair_clip_mode", "wild"], "fair_clip_mode"),
    ("bad normalisation", [PRIV + "normalize_by", "median"], "privacy.init_args.normalize_by must be one of"),
    ("old flat mechanism option", [ALG + "noise_multiplier", "1.5"],
     "has no option 'noise_multiplier'; the privacy mechanism's options are given as "
     "init_args.privacy.init_args.noise_multiplier"),
    ("old flat clustered option", lambda tmp: _config(tmp, "ifca.yaml", "model:\n  algorithm:\n    class_path: "
                                                      "fedfdp.algorithms.IFCA\n    init_args: {num_clusters: 2, "
                                                      "batch_size: 8}\n"),
     "has no option 'batch_size'; the privacy mechanism's options are given as init_args.privacy.init_args.batch_size"),
    ("clustered without mechanism", lambda tmp: _config(tmp, "ifca.yaml", "model:\n  algorithm:\n    class_path: "
                                                        "fedfdp.algorithms.IFCA\n    init_args: {num_clusters: 2}\n"),
     "IFCA is private: algorithm.privacy must be a fedfdp.privacy.EpochDPSGD, got"),
    ("delta >= 1", ["--trainer.callbacks.init_args.delta", "1.5"], "RDPAccounting.delta must be in (0, 1)"),
    ("target eps negative", ["--trainer.callbacks.init_args.target_epsilon", "-1"], "target_epsilon"),
    ("bad initial loss", [ALG + "initial_broadcast_loss", "huge"], "initial_broadcast_loss"),
    ("negative rounds", ["--model.num_rounds", "-3"], "model.num_rounds must be >= 1"),
    ("eval_every zero", ["--model.eval_every", "0"], "model.eval_every must be >= 1"),
    ("too many sampled clients", ["--model.clients_per_round", "9"], "model.clients_per_round must be <="),
    ("unknown algorithm", ["--model.algorithm", "fedfdp.algorithms.Nope"], "fedfdp.algorithms.FedFDP"),
    ("retired twin algorithm", ["--model.algorithm", "fedfdp.algorithms.DPFedProx"],
     "fedfdp.algorithms.DPFedProx was retired: use class_path fedfdp.algorithms.FedProx with init_args.privacy"),
    ("unknown callback", ["--trainer.callbacks+=callbacks.Nope"], "trainer.callbacks"),
    ("second accountant", ["--trainer.callbacks+=callbacks.RDPAccounting"], "has 2 privacy accountants"),
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
    # the newcomer's mistakes: config files, typo'd keys, values jsonargparse used to bury in noise
    ("empty config file", lambda tmp: _config(tmp, "empty.yaml", ""), "is empty"),
    ("missing config file", ["--config", "/nonexistent/fedfdp.yaml"], "config file /nonexistent/fedfdp.yaml does not exist"),
    ("config is a directory", lambda tmp: ["--config", str(tmp)], "is a directory"),
    ("config not a mapping", lambda tmp: _config(tmp, "list.yaml", "- model\n- data\n"), "not a mapping"),
    ("config not YAML", lambda tmp: _config(tmp, "broken.yaml", "model: {num_rounds: 2\n"), "not valid YAML"),
    ("abbreviated key", ["--model.num_round", "3"], "did you mean --model.num_rounds?"),
    ("typo'd key", ["--model.num_rouns", "3"], "did you mean --model.num_rounds?"),
    ("typo'd key in YAML", lambda tmp: _config(tmp, "typo.yaml", "model:\n  num_round: 3\n"),
     "model has no option 'num_round'; did you mean 'num_rounds'?"),
    ("typo'd section in YAML", lambda tmp: _config(tmp, "typo.yaml", "modle:\n  num_rounds: 3\n"),
     "did you mean 'model'?"),
    ("typo'd algorithm option", [ALG + "fairnes_weight", "0.5"], "has no option 'fairnes_weight'; did you mean "
                                                                 "'fairness_weight'?"),
    ("typo'd data option", ["--data.init_args.num_client", "3"], "did you mean 'num_clients'?"),
    ("typo'd callback option", lambda tmp: _config(tmp, "cb.yaml", "trainer:\n  callbacks:\n"
                                                   "  - class_path: callbacks.RDPAccounting\n"
                                                   "    init_args: {target_epsilon: 10.0, delt: 1.0e-5}\n"),
     "did you mean 'delta'?"),
    ("misspelled datamodule", ["--data", "datamodules.FashionMnistDataModule"],
     "did you mean 'FashionMNISTDataModule'?"),
    ("wandb mode", ["--wandb", "bogus"], "wandb must be one of 'auto', 'online', 'offline', 'disabled'"),
    ("non-numeric seed", ["--seed_everything", "abc"], "seed_everything must be"),
    ("negative eval batch", ["--model.eval_batch_size", "-5"], "model.eval_batch_size must be >= 1"),
    ("LightningCLI optimizer", ["--optimizer", "torch.optim.Adam"], "optimizer is not used by fedfdp"),
    ("bad trainer devices", ["--trainer.devices", "abc"], "trainer: `devices`"),
    ("missing checkpoint", ["--ckpt_path", "/nonexistent/last.ckpt"], "ckpt_path"),
    ("impossible Dirichlet", ["--data.init_args.num_clients", "100", "--data.init_args.alpha", "0.01"],
     "accepted: a larger alpha, fewer clients or partition: iid"),
    ("min_size below 2", ["--data.init_args.min_size", "1"], "data.min_size must be null or an integer >= 2"),
    ("NaN in float data", _har_with_nan, "body_acc_y_train.txt: NaN or Inf in 1 row"),
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """An earlier run whose results must survive every bad invocation in the same run directory."""
    run_dir = tmp_path_factory.mktemp("earlier") / "run"
    assert main(["--config", TINY, "--run_dir", str(run_dir), "--model.num_rounds", "1"]) == 0
    return run_dir, _snapshot(run_dir)


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("args, expected", [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_input_one_line_exit_2(tmp_path, capsys, args, expected):
    extra = args(tmp_path) if callable(args) else args
    code = main(["--config", TINY, "--run_dir", str(tmp_path / "run"), *extra])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2
    assert len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "run").exists()  # a refused start leaves no run directory behind


@pytest.mark.slow
@pytest.mark.parametrize("args", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_resume_leaves_the_earlier_run_untouched(tmp_path, capsys, finished_run, args):
    """The same mistakes in a resume of a finished run: refused (a different configuration is
    refused before anything else about the run directory), and no file of the run changes."""
    run_dir, files = finished_run
    extra = args(tmp_path) if callable(args) else args
    code = main(["--config", TINY, "--run_dir", str(run_dir), "--ckpt_path", "last", *extra])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(err) == 1, err
    assert _snapshot(run_dir) == files


def test_there_are_at_least_twenty_cases():
    assert len(CASES) >= 20
