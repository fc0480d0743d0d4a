"""Every ``rcdpfl-table`` dataset's configs (``configs/rcdpfl/<dataset>_<method>.yaml``) hold
everything but the method fixed: a row of the table may differ from another only in what makes it
that method, so that the table compares methods and not settings.

Checked for every dataset prefix found on disk (a new one is checked without being listed): the
data (split, shards, partition seed), the model, rounds, evaluation schedule, seed and trainer;
for the private methods the clip bound, ε, δ and local epochs; the reference models of the fairness
columns; and DPFedAvg's ``(sample_rate, local_steps)``, which spell the others' batch size and one
local epoch (q = b / N, ⌊N / b⌋ steps). The learning rate is one for the federated methods; each
client alone may use the authors' local lr (documented in the config's header).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import yaml

from fedfdp.experiments.rcdpfl import LABELS, MAJORITY
from tests.conftest import REPO

CONFIGS = REPO / "configs" / "rcdpfl"
#: the methods that train no private model and have no accountant
NON_PRIVATE = {"local_nodp"}
#: the methods whose lr may be the authors' local one
ALONE = {"local", "local_nodp"}


def _tables() -> dict[str, dict[str, dict[str, Any]]]:
    """``{dataset: {method: config}}`` for every config file, its method the longest known suffix."""
    methods = sorted((m for m in LABELS if m != MAJORITY), key=len, reverse=True)
    tables: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for path in sorted(CONFIGS.glob("*.yaml")):
        method = next((m for m in methods if path.stem.endswith("_" + m)), None)
        assert method is not None, f"{path.name}: no rcdpfl-table method ends its name ({', '.join(methods)})"
        tables[path.stem[: -len(method) - 1]][method] = yaml.safe_load(path.read_text())
    return dict(tables)


TABLES = _tables()


def _args(config: dict[str, Any]) -> dict[str, Any]:
    return config["model"]["algorithm"]["init_args"]


def _loop(config: dict[str, Any]) -> dict[str, Any]:
    """The local loop's options of a row: the algorithm's, with a clustered row's b and K from its
    mechanism (``privacy: EpochDPSGD``)."""
    args = _args(config)
    privacy = args.get("privacy")
    if isinstance(privacy, dict) and privacy["class_path"].endswith(".EpochDPSGD"):
        return {**args, **(privacy.get("init_args") or {})}
    return args


def _mechanism(config: dict[str, Any]) -> dict[str, Any]:
    """The DP options of a row: its ``privacy`` node's (a private FedAvg) or the algorithm's own."""
    args = _args(config)
    return args["privacy"].get("init_args") or {} if isinstance(args.get("privacy"), dict) else args


def _callback(config: dict[str, Any], name: str) -> dict[str, Any] | None:
    found = [cb.get("init_args", {}) for cb in config["trainer"].get("callbacks", [])
             if cb["class_path"].endswith("." + name)]
    return found[0] if found else None


def _same(table: dict[str, dict[str, Any]], what: str, value, methods=None) -> None:
    values = {m: repr(value(c)) for m, c in table.items() if methods is None or m in methods}
    assert len(set(values.values())) == 1, f"{what} differs between the rows: {values}"


def test_every_dataset_has_the_methods_of_its_table():
    assert {"digits", "mnist", "fmnist", "mnist_paper", "fmnist_paper"} <= set(TABLES)
    for dataset, table in TABLES.items():
        assert {"dpfedavg", "rcdpfl", "oracle", "local", "local_nodp"} <= set(table), dataset


@pytest.mark.parametrize("dataset", sorted(TABLES))
def test_the_rows_of_a_table_differ_only_in_the_method(dataset):
    table = TABLES[dataset]
    private = set(table) - NON_PRIVATE
    _same(table, "data", lambda c: c["data"])
    _same(table, "the model", lambda c: c["model"]["client"])
    _same(table, "num_rounds", lambda c: c["model"]["num_rounds"])
    _same(table, "eval_every", lambda c: c["model"].get("eval_every"))
    _same(table, "seed_everything", lambda c: c.get("seed_everything"))
    _same(table, "the trainer", lambda c: {k: v for k, v in c["trainer"].items() if k != "callbacks"})
    _same(table, "the reference models", lambda c: _callback(c, "ClusterMetrics"))
    _same(table, "max_grad_norm", lambda c: _mechanism(c)["max_grad_norm"], private)
    _same(table, "target ε and δ", lambda c: {k: _callback(c, "RDPAccounting")[k] for k in ("target_epsilon", "delta")},
          private)
    _same(table, "the lr of the federated methods", lambda c: _args(c)["lr"], set(table) - ALONE)
    _same(table, "the lr of each client alone", lambda c: _args(c)["lr"], ALONE & set(table))
    for method in NON_PRIVATE & set(table):
        assert _callback(table[method], "RDPAccounting") is None and "max_grad_norm" not in _args(table[method])
        assert _args(table[method]).get("privacy") is None
    batched = {m: c for m, c in table.items() if "batch_size" in _loop(c)}
    assert ALONE & set(table) <= set(batched) and "rcdpfl" in batched, sorted(batched)
    _same(batched, "batch_size", lambda c: _loop(c)["batch_size"])
    _same(batched, "local_epochs", lambda c: _loop(c)["local_epochs"])


@pytest.mark.parametrize("dataset", sorted(TABLES))
def test_dpfedavg_spells_the_batch_and_the_epoch_of_the_other_rows(dataset):
    table = TABLES[dataset]
    args = _mechanism(table["dpfedavg"])
    batch, epochs = _loop(table["rcdpfl"])["batch_size"], _loop(table["rcdpfl"])["local_epochs"]
    records = table["rcdpfl"]["data"]["init_args"]["train_per_client"]
    assert args["sample_rate"] == pytest.approx(batch / records, rel=1e-12), (dataset, args["sample_rate"], batch, records)
    assert args["local_steps"] == epochs * (records // batch), (dataset, args["local_steps"])
