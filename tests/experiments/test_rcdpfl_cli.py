"""Clustered datamodules (digits, IDX and CIFAR-10 on generated files), the RC-DPFL CLI run and its harness."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch
import yaml

from datamodules import ClusteredCIFAR10DataModule, ClusteredDigitsDataModule, ClusteredMNISTDataModule
from datamodules.idx import FILE_NAMES
from fedfdp.errors import ConfigError
from fedfdp.experiments.__main__ import main
from fedfdp.experiments.rcdpfl import make_config, write_table
from fedfdp.privacy.accounting import DPEvent, epsilon_of
from tests.conftest import REPO
from tests.idx_files import write_idx



def test_digits_clusters_sizes_and_rotation():
    dm = ClusteredDigitsDataModule(cluster_sizes=[1, 2, 2], train_per_client=30, test_per_client=10,
                                   sampling="disjoint", partition_seed=3)
    dm.setup()
    assert dm.num_clients == 5 and dm.client_cluster.tolist() == [0, 1, 1, 2, 2] and dm.minority_clusters == [0]
    assert dm.train_sizes.tolist() == [30] * 5 and dm.test_sizes.tolist() == [10] * 5
    used = np.concatenate([np.concatenate(p) for p in dm._indices])
    assert len(np.unique(used)) == len(used)  # disjoint
    raw = ClusteredDigitsDataModule(cluster_sizes=[1, 2, 2], train_per_client=30, test_per_client=10,
                                    sampling="disjoint", partition_seed=3, shift="label_flip")
    raw.setup()  # same samples, labels shifted instead of rotated
    for cid, k in enumerate(dm.client_cluster):
        x_rot, y_rot = dm.client_train(cid)
        x, y = raw.client_train(cid)
        assert torch.equal(x_rot, torch.rot90(x, int(k), dims=(-2, -1)))
        assert torch.equal(y, (y_rot + int(k)) % 10)
    assert dm.fingerprint() != raw.fingerprint()


def test_overlap_sampling_and_too_large_disjoint_request():
    dm = ClusteredDigitsDataModule(cluster_sizes=[3, 6, 6, 6], train_per_client=400, test_per_client=100,
                                   sampling="overlap")
    dm.setup()
    assert dm.num_clients == 21 and dm.train_sizes.min() == 400
    train_pool = set(np.concatenate([tr for tr, _ in dm._indices]).tolist())
    assert not train_pool & set(np.concatenate([te for _, te in dm._indices]).tolist())  # no train/test leak
    with pytest.raises(ConfigError, match="train_per_client"):
        ClusteredDigitsDataModule(cluster_sizes=[3, 6, 6, 6], train_per_client=400, test_per_client=100).setup()


def test_mnist_loader_on_generated_idx_files(tmp_path):
    rng = np.random.default_rng(0)
    for key, name in FILE_NAMES.items():
        n = 60 if key.startswith("train") else 20
        arr = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8) if "images" in key else (np.arange(n) % 10).astype(np.uint8)
        write_idx(tmp_path / "mnist" / name, arr, gz=True)
    dm = ClusteredMNISTDataModule(data_dir=str(tmp_path), cluster_sizes=[1, 3], train_per_client=12,
                                  test_per_client=4, verify=False)
    dm.setup()
    x, y = dm.client_train(3)
    assert x.shape == (12, 1, 28, 28) and dm.client_cluster.tolist() == [0, 1, 1, 1]


def test_cifar10_loader_on_generated_pickles(tmp_path):
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (10, 3072), dtype=np.uint8), b"labels": list(range(10))}
        (tmp_path / name).write_bytes(pickle.dumps(batch))
    dm = ClusteredCIFAR10DataModule(data_dir=str(tmp_path), cluster_sizes=[1, 2], train_per_client=8,
                                    test_per_client=2, shift="label_flip")
    dm.setup()
    x, y = dm.client_test(2)
    assert x.shape == (2, 3, 32, 32) and dm.num_clients == 3


def test_harness_config_calibrates_dpfedavg_and_writes_a_table(tmp_path):
    config = make_config(REPO / "configs/rcdpfl/digits_dpfedavg.yaml", seed=3, epsilon=2.0, rounds=10)
    args = config["model"]["algorithm"]["init_args"]["privacy"]["init_args"]
    steps = args["local_steps"] * 10
    assert epsilon_of([DPEvent(noise_multiplier=args["noise_multiplier"], sample_rate=args["sample_rate"],
                               steps=steps)], 1e-4) <= 2.0
    assert config["seed_everything"] == 3 and config["model"]["num_rounds"] == 10
    rows = [{"method": m, "target": 5.0, "seed": s, "acc_all": a, "acc_majority": a, "acc_minority": a - 0.1,
             "acc_min": a, "acc_disparity": 0.1, "f_acc": 0.1, "f_loss": 0.2, "clustering_accuracy": float("nan"),
             "gmm_clustering_accuracy": float("nan"), "epsilon": 4.99}
            for m, a in (("dpfedavg", 0.7), ("rcdpfl", 0.9)) for s in (0, 1)]
    table = write_table(rows, tmp_path)
    assert "| 5 | RC-DPFL | 90.0±0.0 | 90.0±0.0 | 80.0±0.0 |" in table and (tmp_path / "results.csv").exists()


@pytest.mark.slow
def test_harness_runs_a_two_round_cli_fit_with_cluster_metrics_within_budget(tmp_path, monkeypatch):
    """The harness command (in-process) runs ``python -m fedfdp.fit`` for 2 rounds and tabulates it."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "table"
    argv = ["rcdpfl-table", "--dataset", "digits", "--methods", "rcdpfl", "--seeds", "0", "--rounds", "2",
            "--out", str(out), "--nice", "0", "--override=--data.init_args.train_per_client=40",
            "--override=--data.init_args.test_per_client=10", "--override=--data.init_args.cluster_sizes=[1,2,2,2]"]
    assert main(argv) == 0
    run_dir = out / "runs" / "digits_rcdpfl_eps5_s0"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_run"] == 2 and summary["algorithm"] == "RCDPFL" and summary["dp_valid"] is True
    assert 0 < summary["epsilon"] <= 5.0
    for key in ("acc_all", "acc_majority", "acc_minority", "f_acc", "f_loss", "clustering_accuracy",
                "gmm_clustering_accuracy"):
        assert key in summary["final"]
    assert "cluster_rounds" in (run_dir / "metrics.csv").read_text().splitlines()[0]
    assert "| 5 | RC-DPFL |" in (out / "table.md").read_text()
    assert main(argv) == 0  # finished runs are skipped


def test_dpfedavg_noise_is_calibrated_on_the_algorithms_own_schedule():
    """The harness calibrates DPFedAvg on its planned per-round events over the run: the z of one
    Poisson-sampled Gaussian mechanism run local_steps × rounds times."""
    from fedfdp.privacy.schedule import calibrate_noise_multiplier

    config = make_config(REPO / "configs/rcdpfl/mnist_dpfedavg.yaml", seed=0, epsilon=3.0, rounds=7)
    args = config["model"]["algorithm"]["init_args"]["privacy"]["init_args"]
    one_stage = lambda z: [DPEvent(noise_multiplier=z, sample_rate=args["sample_rate"],  # noqa: E731
                                   steps=args["local_steps"] * 7)]
    assert args["noise_multiplier"] == calibrate_noise_multiplier(one_stage, target_epsilon=3.0, delta=1e-4)
    assert epsilon_of(one_stage(args["noise_multiplier"]), 1e-4) <= 3.0


LOCAL_CONFIGS = sorted((REPO / "configs" / "rcdpfl").glob("*_local.yaml"))


@pytest.mark.parametrize("local", LOCAL_CONFIGS, ids=lambda p: p.stem)
def test_every_local_dp_sgd_config_has_a_non_private_twin_that_changes_only_the_privacy(local):
    """Each client alone without DP (``<dataset>_local_nodp.yaml``) next to every local DP-SGD
    config: the same data, model, rounds, metrics and local loop (lr, batch, epochs), LocalOnly
    instead of LocalDPSGD, and no accountant (so the harness runs it once per seed, with no ε)."""
    import yaml

    from fedfdp.experiments.rcdpfl import is_private

    dp = yaml.safe_load(local.read_text())
    twin_path = local.with_name(local.name.replace("_local.yaml", "_local_nodp.yaml"))
    assert twin_path.exists(), f"{twin_path.name} missing"
    twin = yaml.safe_load(twin_path.read_text())
    assert is_private(dp) and not is_private(twin)
    for key in ("data", "seed_everything"):
        assert twin[key] == dp[key]
    assert {k: v for k, v in twin["model"].items() if k != "algorithm"} == \
        {k: v for k, v in dp["model"].items() if k != "algorithm"}
    assert [c for c in twin["trainer"]["callbacks"]] == \
        [c for c in dp["trainer"]["callbacks"] if not c["class_path"].endswith("RDPAccounting")]
    assert twin["model"]["algorithm"]["class_path"] == "fedfdp.algorithms.LocalOnly"
    loop = ("lr", "batch_size", "local_epochs")
    dp_args = dp["model"]["algorithm"]["init_args"]  # the private loop's b and K are its mechanism's
    assert {k: twin["model"]["algorithm"]["init_args"][k] for k in loop} == \
        {k: {**dp_args, **dp_args["privacy"]["init_args"]}[k] for k in loop}


def test_harness_runs_a_non_private_method_once_per_seed_and_computes_the_majority_label(tmp_path, capsys,
                                                                                     monkeypatch):
    """``local_nodp`` runs once per seed whatever ``--epsilons`` (no ε in its name), a private method
    once per (ε, seed); ``majority`` is no run: its row, under ε "no DP", is each client's majority
    label scored on its test split, grouped as the clustered metrics are."""
    from callbacks.cluster_metrics import group_accuracies
    from fedfdp.experiments.baselines import datamodule_from_config, majority_label_baseline
    from fedfdp.experiments.rcdpfl import majority_row

    monkeypatch.chdir(REPO)
    argv = ["rcdpfl-table", "--dataset", "digits", "--methods", "local", "local_nodp", "majority", "--epsilons", "2",
            "5", "--seeds", "0", "1", "--out", str(tmp_path), "--dry_run"]
    assert main(argv) == 0
    names = sorted(line.split("--run_dir ")[1].split()[0].rsplit("/", 1)[1]
                   for line in capsys.readouterr().out.splitlines() if "fedfdp.fit" in line)
    assert names == ["digits_local_eps2_s0", "digits_local_eps2_s1", "digits_local_eps5_s0", "digits_local_eps5_s1",
                     "digits_local_nodp_s0", "digits_local_nodp_s1"]

    config = REPO / "configs/rcdpfl/digits_local.yaml"
    row = majority_row(config)
    datamodule = datamodule_from_config(config, labels_only=True)
    accuracy = np.asarray(majority_label_baseline(datamodule)["client_accuracy"])
    assert row["acc_all"] == pytest.approx(accuracy.mean()) and row["acc_min"] == pytest.approx(accuracy.min())
    assert row == {**row, **group_accuracies(accuracy, np.asarray(datamodule.client_cluster),
                                             list(datamodule.minority_clusters))}
    assert 0 < row["acc_all"] < 0.3 and row["epsilon"] is None  # digits are balanced: near 10 %
    table = write_table([row], tmp_path)
    assert f"| no DP | Majority label | {100 * row['acc_all']:.1f} |" in table and table.rstrip().endswith("| – |")


def test_dry_run_skips_a_finished_run_of_a_tree_it_did_not_launch(tmp_path, capsys, caplog, monkeypatch):
    """A tree of finished runs that this tree never launched (restored from docs/complete_runs, or made
    on another machine) has no staged ``<out>/configs/<name>.yaml``: the dry run checks each finished
    run against the config it would make, as the run does, lists only the runs left, and a finished
    run of another configuration gets the runner's error line and exit 1 (the run would fail it), not
    a traceback."""
    from fedfdp.experiments.rcdpfl import make_config

    monkeypatch.chdir(REPO)
    base = REPO / "configs/rcdpfl/digits_local.yaml"
    for name, seed, epsilon in (("digits_local_eps2_s0", 0, 2.0), ("digits_local_eps2_s1", 1, 3.0)):  # s1: another ε
        run_dir = tmp_path / "runs" / name
        run_dir.mkdir(parents=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(make_config(base, seed=seed, epsilon=epsilon, rounds=None)))
        (run_dir / "summary.json").write_text(json.dumps({"status": "budget_spent", "rounds_run": 3, "rounds_planned": 3}))
    argv = ["rcdpfl-table", "--dataset", "digits", "--methods", "local", "--epsilons", "2", "--seeds", "0", "1", "2",
            "--out", str(tmp_path), "--dry_run"]
    assert main(argv) == 1
    listed = [line.split("--run_dir ")[1].split()[0].rsplit("/", 1)[1] for line in capsys.readouterr().out.splitlines()
              if "fedfdp.fit" in line]
    assert listed == ["digits_local_eps2_s2"]
    assert "digits_local_eps2_s1 holds a run of another configuration" in caplog.text
    assert "eps2_s0" not in caplog.text and not (tmp_path / "configs").exists()
    (tmp_path / "runs" / "digits_local_eps2_s1" / "summary.json").unlink()  # unfinished: listed, nothing refused
    caplog.clear()
    assert main(argv) == 0 and "error" not in caplog.text
