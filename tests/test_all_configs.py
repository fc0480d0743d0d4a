"""Every YAML under configs/ parses and instantiates its federation, algorithm, data and callbacks.

Nothing is fitted and no data is loaded (CIFAR-10 files are not available offline; its
datamodule only reads them in ``setup``).
"""

from __future__ import annotations

import pytest

from datamodules.federated import FederatedDataModule
from fedfdp import Federation
from fedfdp.algorithms import Algorithm
from fedfdp.cli.parser import build_cli
from fedfdp.interfaces import is_instance_of
from tests.conftest import REPO

#: fit configs (configs/search_spaces/ holds search spaces of `fedfdp.experiments tune`: tests/test_tune.py)
CONFIGS = sorted(p for p in (REPO / "configs").rglob("*.yaml") if "search_spaces" not in p.parts)


def test_there_is_a_config_per_dataset_and_baseline():
    names = {p.stem for p in CONFIGS}
    for ds in ("fmnist", "mnist", "cifar10"):
        for stem in ("fedprox", "fedprox_dp", "scaffold", "scaffold_dp", "feddyn", "feddyn_dp", "qffl", "qffl_dp",
                     "alidpfl", "ditto", "ditto_dp", "fedavg", "dpfedavg", "fedfair"):
            assert f"{ds}_{stem}" in names


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(REPO / "configs")) for p in CONFIGS])
def test_config_instantiates(path, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.chdir(REPO)
    cli = build_cli(["--config", str(path), "--run_dir", str(tmp_path / "run")])
    assert isinstance(cli.model, Federation)
    assert isinstance(cli.model.algorithm, Algorithm)
    assert isinstance(cli.datamodule, FederatedDataModule)
    for required in cli.model.algorithm.required_callbacks:
        assert any(is_instance_of(cb, required) for cb in cli.trainer.callbacks), required
