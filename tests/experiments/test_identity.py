"""What a run trains and whether a run directory holds it (fedfdp.experiments.provenance), and the
rows of a table are distinct runs (fedfdp.experiments.identity): a check generated over every
harness's rows on every dataset (FinP, RC-DPFL, the FedFDP paper tables)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml

from fedfdp.experiments import finp, paper_tables, rcdpfl
from fedfdp.experiments.identity import distinct_rows, same_runs
from fedfdp.experiments.provenance import parse_overrides, saved_config_differences, trained_config
from fedfdp.experiments.runner import RunSpec
from tests.conftest import REPO, saved_run

BASE = {"seed_everything": 0,
        "model": {"algorithm": {"class_path": "fedfdp.algorithms.DPFinP", "init_args": {"beta": 0.1, "lr": 1e-3}},
                  "num_rounds": 20}}


def _spec(tmp_path: Path, *args: str, seed: int = 0, config: dict | None = None, name: str = "c") -> RunSpec:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config or BASE))
    return RunSpec(run_dir=tmp_path / "run", config=path, seed=seed, args=args)


def test_overrides_are_read_in_either_spelling_as_yaml_values():
    assert parse_overrides(["--a.b", "0.10", "--c=false", "--d", "[1, 2]", "--e", "1e-3", "--f", "--g", "x"]) == {
        "a.b": 0.1, "c": False, "d": [1, 2], "e": 0.001, "f": True, "g": "x"}
    with pytest.raises(ValueError, match="expected an option"):
        parse_overrides(["0.1"])


@pytest.mark.parametrize("args", [
    ("--model.algorithm.init_args.beta", "0.1"),           # restates the config's value
    ("--model.algorithm.init_args.beta=0.10",),            # other spelling of the same number
    ("--model.algorithm.init_args.lr", "1e-3"),            # exponent spelling
    ("--model.algorithm", "fedfdp.algorithms.DPFinP"),     # the class it already is
    ("--model.num_rounds", "20", "--model.algorithm.init_args.beta", "0.1"),
])
def test_an_override_that_restates_the_config_is_the_same_run(tmp_path, args):
    assert same_runs({"plain": _spec(tmp_path), "restated": _spec(tmp_path, *args)}) == {"restated": "plain"}


@pytest.mark.parametrize("args,seed", [
    (("--model.algorithm.init_args.beta", "0.5"), 0),
    (("--model.algorithm", "fedfdp.algorithms.FinP"), 0),   # another class, same init_args
    (("--model.algorithm.init_args.client_reg", "false"), 0),  # a key the config leaves at its default
    ((), 1),                                                 # another seed
])
def test_a_run_that_changes_anything_is_another_run(tmp_path, args, seed):
    assert same_runs({"plain": _spec(tmp_path), "other": _spec(tmp_path, *args, seed=seed)}) == {}


def test_make_config_is_what_a_generated_spec_trains(tmp_path):
    made = RunSpec(run_dir=tmp_path / "r", config=tmp_path / "never_written.yaml", seed=3,
                   make_config=lambda: {**BASE, "seed_everything": 0})
    assert trained_config(made)["seed_everything"] == 3
    assert trained_config(made)["model"] == BASE["model"]


def test_distinct_rows_keeps_the_first_of_each_configuration(tmp_path):
    specs = {"a": _spec(tmp_path), "b": _spec(tmp_path, "--model.num_rounds", "10"),
             "c": _spec(tmp_path, "--model.num_rounds=20"), "d": _spec(tmp_path, "--model.num_rounds", "10.0")}
    assert distinct_rows(list(specs), specs.__getitem__) == (["a", "b"], {"c": "a", "d": "b"})


def _assert_distinct(specs: dict, where: str) -> None:
    assert same_runs(specs) == {}, f"{where}: rows that train the same configuration: {same_runs(specs)}"


@pytest.mark.parametrize("dataset", sorted(finp.DATASETS))
def test_finp_table_never_runs_one_configuration_as_two_rows(dataset, tmp_path, monkeypatch):
    """Every row of every group, as the harness keeps them: pairwise distinct runs; the rows it
    drops each repeat a kept one (the CNN's β-0.1 rows: its configs' own β is 0.1)."""
    monkeypatch.chdir(REPO)
    rows = [r for r in finp.ROWS if finp.DATASETS[dataset].path(finp.ROWS[r][2]) is not None]
    kept, dropped = finp.distinct_table_rows(rows, 0, tmp_path, None, dataset)
    trained = [r for r in kept if finp.ROWS[r][2] != finp.MAJORITY]
    _assert_distinct({r: finp.run_spec(r, 0, tmp_path, None, dataset) for r in trained}, f"finp-table {dataset}")
    assert set(kept) | set(dropped) == set(rows) and all(same in kept for same in dropped.values())
    if dataset == "fmnist_cnn":
        assert dropped == {"finp_pca_b0.1": "finp_pca", "finp_ala_b0.1": "finp_ala", "dpfinp_ala": "dpfinp_ala_b0.1"}


def _rcdpfl_datasets() -> list[str]:
    return sorted({p.name.rsplit("_", 1)[0] for p in (REPO / "configs" / "rcdpfl").glob("*_local.yaml")})


@pytest.mark.parametrize("dataset", _rcdpfl_datasets())
def test_rcdpfl_table_methods_are_distinct_runs(dataset, tmp_path):
    """Every method config of an RC-DPFL dataset, made as the harness makes it (seed 0, ε 5)."""
    specs = {}
    for method in rcdpfl.LABELS:
        base = REPO / "configs" / "rcdpfl" / f"{dataset}_{method}.yaml"
        if method == rcdpfl.MAJORITY or not base.exists():
            continue
        private = rcdpfl.is_private(yaml.safe_load(base.read_text()))
        specs[method] = RunSpec(run_dir=tmp_path / method, config=tmp_path / f"{method}.yaml", make_config=(
            lambda base=base, private=private: rcdpfl.make_config(base, seed=0, epsilon=5.0 if private else None,
                                                                  rounds=None)))
    assert len(specs) >= 7
    _assert_distinct(specs, f"rcdpfl-table {dataset}")


@pytest.mark.parametrize("table", sorted(paper_tables.TABLES))
def test_paper_table_methods_are_distinct_runs_in_every_column(table, tmp_path):
    runs = [run for run in paper_tables.plan_runs(table, list(paper_tables.TABLES[table].default_datasets), [0],
                                                  tmp_path, REPO / "configs")
            if run.config.exists()]
    assert runs
    for column, group in itertools.groupby(sorted(runs, key=lambda r: r.column.label), key=lambda r: r.column.label):
        _assert_distinct({run.method: run.spec(None, ()) for run in group}, f"{table} {column}")


# ---- a finished run against what its spec asks for (saved_config_differences) ----------------------
TINY = REPO / "tests" / "configs" / "tiny_dpfedavg.yaml"
LR = "model.algorithm.init_args.lr"


@pytest.mark.parametrize("args", [
    (),
    ("--model.algorithm.init_args.lr", "0.5"),   # the run was launched with this override
    ("--model.algorithm.lr=0.5",),               # the spelling without init_args
    ("--model.algorithm.init_args.lr", "5e-1"),  # exponent spelling (a string to YAML 1.1)
    ("--model.algorithm", "fedfdp.algorithms.FedAvg", "--model.algorithm.init_args.lr", "0.5"),  # its own class
    ("--model.algorithm", "FedAvg", "--model.algorithm.init_args.lr", "0.5"),  # a bare class name
    ("--trainer.enable_progress_bar", "true", "--wandb", "disabled", "--model.algorithm.init_args.lr", "0.5",
     "--data.init_args.seed", "0"),  # logging options (HARMLESS) and a restated value
])
def test_a_finished_run_agrees_with_every_spelling_of_its_own_configuration(tmp_path, args):
    run = saved_run(tmp_path, TINY, "--model.algorithm.init_args.lr", "0.5")
    if not args:  # the config's own lr 1.0 is not the run's 0.5
        assert saved_config_differences(RunSpec(run, TINY, seed=0)) == [f"{LR}: the run trained 0.5, asked 1.0"]
        return
    assert saved_config_differences(RunSpec(run, TINY, seed=0, args=args)) == []


@pytest.mark.parametrize("args,seed,path", [
    (("--model.algorithm.init_args.lr", "0.25"), 0, LR),
    (("--model.algorithm.lr", "0.25"), 0, LR),
    ((), 1, "seed_everything"),
    (("--model.algorithm", "fedfdp.algorithms.DPFedAvgAdaClip"), 0, "model.algorithm.class_path"),
    (("--model.num_rounds", "3"), 0, "model.num_rounds"),
    (("--data.init_args.num_clients", "4"), 0, "data.init_args.num_clients"),
    (("--trainer.callbacks", '[{"class_path": "callbacks.RDPAccounting"}, {"class_path": "callbacks.RDPAccounting"}]'),
     0, "trainer.callbacks"),  # another number of callbacks
])
def test_a_finished_run_differs_from_a_spec_that_changes_anything(tmp_path, args, seed, path):
    run = saved_run(tmp_path, TINY)
    diffs = saved_config_differences(RunSpec(run, TINY, seed=seed, args=args))
    assert len(diffs) == 1 and diffs[0].startswith(f"{path}:"), diffs


def test_a_run_without_a_saved_config_has_nothing_to_differ(tmp_path):
    assert saved_config_differences(RunSpec(tmp_path / "none", TINY)) == []
