"""Every YAML under configs/ parses and instantiates its federation, algorithm, data and callbacks.

Nothing is fitted and no data is loaded (CIFAR-10 files are not available offline; its
datamodule only reads them in ``setup``).
"""

from __future__ import annotations

import pytest
import yaml

from datamodules.federated import FederatedDataModule
from fedfdp import Federation
from fedfdp.algorithms import Algorithm
from fedfdp.cli.parser import build_cli
from fedfdp.interfaces import is_instance_of
from tests.conftest import REPO

#: fit configs (configs/search_spaces/ holds search spaces of `fedfdp.experiments tune`: tests/test_tune.py)
CONFIGS = sorted(p for p in (REPO / "configs").rglob("*.yaml") if "search_spaces" not in p.parts)
MAIN_CONFIG = REPO / "configs" / "fmnist.yaml"


def _algorithm(path) -> str:
    algorithm = ((yaml.safe_load(path.read_text()) or {}).get("model") or {}).get("algorithm")
    return str(algorithm.get("class_path") if isinstance(algorithm, dict) else algorithm)


def _fast_lane_configs() -> set:
    """The main job's config and one config of each algorithm (a FashionMNIST one where there is one):
    these instantiate in the fast lane (``pytest -m "not slow"``), every other config only in the full run."""
    chosen = {_algorithm(MAIN_CONFIG): MAIN_CONFIG}
    for path in sorted(CONFIGS, key=lambda p: (not p.name.startswith("fmnist"), str(p))):
        chosen.setdefault(_algorithm(path), path)
    return set(chosen.values())


_FAST = _fast_lane_configs()
_PARAMS = [pytest.param(p, id=str(p.relative_to(REPO / "configs")), marks=() if p in _FAST else pytest.mark.slow)
           for p in CONFIGS]


def test_there_is_a_config_per_dataset_and_baseline():
    names = {p.stem for p in CONFIGS}
    for ds in ("fmnist", "mnist", "cifar10"):
        for stem in ("fedprox", "fedprox_dp", "scaffold", "scaffold_dp", "feddyn", "feddyn_dp", "qffl", "qffl_dp",
                     "alidpfl", "ditto", "ditto_dp", "fedavg", "dpfedavg", "fedfair"):
            assert f"{ds}_{stem}" in names


@pytest.mark.parametrize("path", _PARAMS)
def test_config_instantiates(path, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.chdir(REPO)
    cli = build_cli(["--config", str(path), "--run_dir", str(tmp_path / "run")])
    assert isinstance(cli.model, Federation)
    assert isinstance(cli.model.algorithm, Algorithm)
    assert isinstance(cli.datamodule, FederatedDataModule)
    for required in cli.model.algorithm.required_callbacks:
        assert any(is_instance_of(cb, required) for cb in cli.trainer.callbacks), required
