"""The reproduction harness: overrides, aggregation maths on fake summaries, and a tiny end-to-end table."""

from __future__ import annotations

import json

import pytest
import yaml

from fedfdp.experiments import stop_signals
from fedfdp.experiments.__main__ import main
from fedfdp.experiments.paper_tables import Column, Run, apply_overrides, collect, execute, markdown_table, plan_runs
from tests.conftest import REPO

TINY = REPO / "tests" / "configs" / "tiny_fedfdp.yaml"


def test_apply_overrides_sets_dotted_keys_and_callback_args():
    config = {"model": {"algorithm": {"init_args": {"lr": 1.0}}},
              "trainer": {"callbacks": [{"class_path": "callbacks.RDPAccounting", "init_args": {"target_epsilon": 3.52}}]}}
    apply_overrides(config, {"callback:callbacks.RDPAccounting.target_epsilon": 1.0, "data.init_args.alpha": 0.5,
                             "model.algorithm.init_args.privacy.init_args.noise_multiplier": 1.65, "model.num_rounds": 7})
    assert config["trainer"]["callbacks"][0]["init_args"]["target_epsilon"] == 1.0
    assert config["data"]["init_args"]["alpha"] == 0.5 and config["model"]["num_rounds"] == 7
    assert "noise_multiplier" not in config["model"]["algorithm"]["init_args"]  # non-private: σ does not apply


def _fake(run_dir, acc, psi, rounds=10, planned=10):
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({
        "rounds_run": rounds, "rounds_planned": planned, "final": {"accuracy": acc, "psi": psi, "accuracy_worst": acc},
        "best_accuracy": acc, "epsilon": 1.0, "seconds_per_round": 2.0}))


def test_aggregation_mean_std_over_seeds_and_unfinished_runs_are_left_out(tmp_path):
    col = Column("FMNIST", "fmnist")
    runs = [Run("table4", "FedAvg", "dpfedavg", col, s, TINY, tmp_path / f"s{s}") for s in range(3)]
    _fake(runs[0].run_dir, 0.80, 1e-2)
    _fake(runs[1].run_dir, 0.90, 3e-2)
    _fake(runs[2].run_dir, 0.10, 9.0, rounds=5)  # interrupted: not counted
    rows = collect(runs)
    assert [r["seed"] for r in rows] == [0, 1]
    md = markdown_table("T", ["FedAvg", "FedFDP"], ["FMNIST"], rows)
    # mean 85, sample std sqrt(((80-85)^2 + (90-85)^2)/1) = 7.07; Ψ 2.0e-2 ± 1.4e-2
    assert "| FedAvg | 85.00±7.07 | 2.0e-02±1.4e-02 |" in md
    assert "| FedFDP | — | — |" in md
    assert md.splitlines()[2] == "| Method | FMNIST Acc (%) | FMNIST Ψ |"


def test_a_run_finished_after_planning_is_not_started_again(tmp_path, monkeypatch):
    """Two harnesses on one --out: the second must not restart (and fail on) a run the first finished."""
    run = Run("table4", "FedAvg", "dpfedavg", Column("FMNIST", "fmnist"), 0, TINY, tmp_path / "s0")
    _fake(run.run_dir, 0.80, 1e-2)
    (run.run_dir / "harness.json").write_text(json.dumps({"command": ["fit"], "returncode": 0, "wall_seconds": 12.5}))
    monkeypatch.setattr(stop_signals, "launch", lambda *a, **k: (_ for _ in ()).throw(AssertionError("started again")))
    assert execute(run, None, 0, []) == (run, 0, 12.5)
    assert json.loads((run.run_dir / "harness.json").read_text())["wall_seconds"] == 12.5
    assert not (run.run_dir / "input_config.yaml").exists()


def test_plan_covers_methods_columns_and_seeds(tmp_path):
    runs = plan_runs("table6", ["fmnist"], [0, 1], tmp_path, REPO / "configs")
    assert len(runs) == 8 * 4 * 2  # 7 DP methods and each client alone with DP-SGD
    assert all(r.config.exists() for r in runs)
    assert {r.stem for r in plan_runs("table4", ["fmnist", "mnist"], [0], tmp_path, REPO / "configs")} >= {"local_dp"}
    assert {r.column.label for r in runs} == {"FMNIST eps=1", "FMNIST eps=2", "FMNIST eps=3", "FMNIST eps=4"}


@pytest.mark.slow
def test_tiny_table_end_to_end_and_resumable(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(REPO)
    configs = tmp_path / "configs"
    configs.mkdir()
    fedfdp = yaml.safe_load(TINY.read_text())
    (configs / "fmnist.yaml").write_text(yaml.safe_dump(fedfdp))
    dp = yaml.safe_load(TINY.read_text())
    dp["model"]["algorithm"] = {"class_path": "fedfdp.algorithms.Scaffold",
                                "init_args": {"lr": 1.0, "privacy": {
                                    "class_path": "fedfdp.privacy.SampleLevelDP",
                                    "init_args": {"sample_rate": 0.2, "max_grad_norm": 1.0, "noise_multiplier": 1.0}}}}
    dp["trainer"]["callbacks"] = dp["trainer"]["callbacks"][1:]
    (configs / "fmnist_scaffold_dp.yaml").write_text(yaml.safe_dump(dp))
    out = tmp_path / "out"
    args = ["paper-table4", "--dataset", "fmnist", "--methods", "SCAFFOLD", "FedFDP", "--seeds", "0",
            "--rounds", "1", "--out", str(out), "--config-dir", str(configs)]
    assert main(args) == 0
    md = (out / "table4.md").read_text()
    assert "| SCAFFOLD |" in md and "| FedFDP |" in md and "—" not in md.split("\n\n")[1].splitlines()[2]
    assert (out / "table4.png").stat().st_size > 0
    assert len((out / "table4.csv").read_text().splitlines()) == 3
    summary = json.loads((out / "table4" / "fmnist" / "fedfdp" / "seed0" / "summary.json").read_text())
    assert summary["rounds_run"] == 1
    caplog.clear()
    with caplog.at_level("INFO", logger="fedfdp.experiments.paper_tables"):
        assert main(args) == 0  # everything finished: nothing is run again
    assert "2 finished, 0 to run" in caplog.text
    # a config edited after its runs finished: they are not its runs (neither tabulated nor run again)
    dp["model"]["algorithm"]["init_args"]["lr"] = 0.5
    (configs / "fmnist_scaffold_dp.yaml").write_text(yaml.safe_dump(dp))
    monkeypatch.setattr(stop_signals, "launch", lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
    caplog.clear()
    with caplog.at_level("ERROR", logger="fedfdp.experiments.runner"):
        assert main(args) == 1
    (error,) = caplog.messages
    assert "scaffold_dp/seed0 holds a run of another configuration" in error
    assert "model.algorithm.init_args.lr: the run trained 1.0, asked 0.5" in error
    md = (out / "table4.md").read_text()
    assert "| FedFDP |" in md and "| SCAFFOLD |" not in md


def test_each_client_alone_takes_every_private_columns_epsilon_sigma_and_split(tmp_path):
    """The local-only rows of Tables IV-VI run at the column's split and dataset, like the federated
    rows: with DP-SGD at the column's ε and σ (Table VI), β and client count (Table V), dataset
    (Table IV); without DP (no accountant) wherever a column changes the data (IV and V: each of
    their columns has the row), not in Table VI, whose columns change only ε."""
    algorithms = {"local_dp": "fedfdp.algorithms.LocalOnly", "local": "fedfdp.algorithms.LocalOnly"}  # privacy tells
    for table, datasets in (("table4", ["fmnist", "mnist"]), ("table5", ["fmnist"]), ("table6", ["fmnist"])):
        runs = plan_runs(table, datasets, [0], tmp_path, REPO / "configs")
        columns = {r.column.label for r in runs}
        for stem in algorithms:
            with_row = {r.column.label for r in runs if r.stem == stem}
            assert with_row == (set() if (table, stem) == ("table6", "local") else columns), (table, stem)
        for run in runs:
            if run.stem not in algorithms:
                continue
            config = run.spec(None, []).make_config()
            assert config["model"]["algorithm"]["class_path"] == algorithms[run.stem]
            privacy = config["model"]["algorithm"].get("init_args", {}).get("privacy")
            assert (privacy or {}).get("class_path") == ("fedfdp.privacy.SampleLevelDP" if run.stem == "local_dp"
                                                         else None), run.config
            assert config["data"]["class_path"] == {"fmnist": "datamodules.FashionMNISTDataModule",
                                                    "mnist": "datamodules.MNISTDataModule"}[run.column.dataset]
            accountants = [cb for cb in config["trainer"].get("callbacks") or []
                           if cb["class_path"] == "callbacks.RDPAccounting"]
            assert len(accountants) == (1 if run.stem == "local_dp" else 0), run.config
            for key, value in run.column.overrides.items():
                if key.startswith("callback:"):
                    (callback,) = [cb for cb in config["trainer"]["callbacks"] if cb["class_path"] == "callbacks.RDPAccounting"]
                    assert callback["init_args"]["target_epsilon"] == value
                else:
                    node = config
                    for part in key.split("."):
                        node = node[part]
                    assert node == value
