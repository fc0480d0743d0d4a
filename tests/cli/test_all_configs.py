"""Every YAML under configs/ parses and instantiates its federation, algorithm, data and callbacks,
and the config.yaml a run of it saves is recognised as that config's run, and as no other.

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
from fedfdp.experiments.provenance import saved_config_differences
from fedfdp.experiments.runner import RunSpec
from fedfdp.rundir import HARMLESS
from fedfdp.interfaces import is_instance_of
from tests.conftest import REPO

#: fit configs (configs/search_spaces/ holds search spaces of `fedfdp.experiments tune`: tests/experiments/test_tune.py)
CONFIGS = sorted(p for p in (REPO / "configs").rglob("*.yaml") if "search_spaces" not in p.parts)
MAIN_CONFIG = REPO / "configs" / "fmnist.yaml"


def _algorithm(path) -> str:
    """The algorithm's class path, and its privacy mechanism's (FedAvg and FedAvg with privacy are two algorithms)."""
    algorithm = ((yaml.safe_load(path.read_text()) or {}).get("model") or {}).get("algorithm")
    if not isinstance(algorithm, dict):
        return str(algorithm)
    privacy = (algorithm.get("init_args") or {}).get("privacy")
    mechanism = privacy.get("class_path") if isinstance(privacy, dict) else None
    return str(algorithm.get("class_path")) + (f"+{mechanism}" if mechanism else "")


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


def _numbers(node, prefix=""):
    """``(dotted key, number)`` for every number a config sets outside lists, logging options left out."""
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if any(path == h or path.startswith(h + ".") for h in HARMLESS):
            continue
        if isinstance(value, dict):
            yield from _numbers(value, path)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            yield path, value


@pytest.mark.parametrize("path", _PARAMS)
def test_a_finished_run_of_a_config_is_its_run_and_not_a_changed_ones(path, tmp_path, monkeypatch):
    """What the runner checks before it skips a finished run (fedfdp.experiments.identity): the
    resolved ``config.yaml`` of a run of ``path`` agrees with ``path`` (no difference where there is
    none: defaults filled in, numbers re-spelled, class paths), and differs from ``path`` with any one
    of its numbers changed (each named)."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.chdir(REPO)
    cli = build_cli(["--config", str(path), "--run_dir", str(tmp_path / "run")])
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "config.yaml").write_text(yaml.safe_dump(cli._dump(cli.config), sort_keys=False))
    assert saved_config_differences(RunSpec(saved, path)) == []
    numbers = list(_numbers(yaml.safe_load(path.read_text())))
    assert numbers, path
    for key, value in numbers:
        changed = RunSpec(saved, path, args=(f"--{key}={value * 2 + 1!r}",))
        assert [d.split(":")[0] for d in saved_config_differences(changed)] == [key]
