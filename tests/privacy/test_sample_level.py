"""The privacy component an algorithm is given (``privacy=SampleLevelDP(...)``), and the spelling it replaced.

Invariants, not examples: every registered algorithm either takes ``privacy`` or is one of the
clustered family (own calibrated z_i); no twin class is left; every config a committed run saved in
the old spelling reads as an algorithm of today's that instantiates; a config written in the old
spelling and the same config in today's spelling are one config.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedfdp import algorithms
from fedfdp.algorithms.fedavg import FedAvg
from fedfdp.algorithms.clustered import ClusteredDPFL
from fedfdp.algorithms.retired import CLUSTERED_OPTIONS, MECHANISM_OPTIONS, TWINS, upgrade_config, upgrade_key
from fedfdp.errors import ConfigError
from fedfdp.privacy import EpochDPSGD, PrivacyMechanism, SampleLevelDP

REPO = Path(__file__).resolve().parents[2]
#: FedFair's dynamic learning rate scales a step by its batch's loss, which no per-sample clip bounds:
#: its private form is another algorithm of the paper, FedFDP (fair per-sample clipping, Algorithm 2).
NON_PRIVATE = {"FedFair"}


def _classes() -> dict[str, type]:
    return {name: obj for name, obj in algorithms.load_all().items()
            if inspect.isclass(obj) and issubclass(obj, algorithms.Algorithm) and obj is not algorithms.Algorithm}


def _init_options(cls: type) -> set[str]:
    """Every option ``cls(...)`` takes, following ``**kwargs`` up the classes it is passed to."""
    options: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(klass.__init__).parameters
        options |= {n for n, p in parameters.items() if p.kind is not p.VAR_KEYWORD and n != "self"}
        if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            break
    return options


def _instantiate(node: dict[str, Any]) -> Any:
    module, _, name = node["class_path"].rpartition(".")
    args = dict(node.get("init_args") or {})
    if isinstance(args.get("privacy"), dict):
        args["privacy"] = _instantiate(args["privacy"])
    return getattr(importlib.import_module(module), name)(**args)


def test_no_twin_class_is_left_and_every_other_algorithm_takes_privacy():
    classes = _classes()
    assert not set(TWINS) & set(classes), "a retired twin is registered again"
    for name, cls in classes.items():
        if name in NON_PRIVATE:
            continue
        own = _init_options(cls)
        assert "privacy" in own, f"{name} cannot be given a privacy mechanism"
        assert not set(MECHANISM_OPTIONS) - {"sample_rate"} & own, f"{name} lists the mechanism's options itself"
        if issubclass(cls, ClusteredDPFL):  # the family's local DP-SGD options are its mechanism's
            assert not set(CLUSTERED_OPTIONS) & own, f"{name} lists the mechanism's options itself"


@pytest.mark.parametrize("name", sorted(set(TWINS)))
def test_a_retired_twin_is_refused_with_the_spelling_that_replaced_it(name):
    with pytest.raises(AttributeError, match=rf"fedfdp.algorithms.{name} was retired: use class_path "
                                              rf"fedfdp.algorithms.{TWINS[name]} with init_args.privacy"):
        getattr(algorithms, name)


def test_the_mechanism_owns_sampling_noise_and_events():
    mechanism = SampleLevelDP(sample_rate=0.2, max_grad_norm=0.5, noise_multiplier=1.3, local_steps=3)
    assert isinstance(mechanism, PrivacyMechanism) and mechanism.unit == "record"
    [(kind, event)] = mechanism.planned_events()
    assert (kind, event.noise_multiplier, event.sample_rate, event.steps) == ("model", 1.3, 0.2, 3)
    [release] = mechanism.releases()
    assert (release.noise_multiplier, release.clip_bound) == (1.3, 0.5)
    assert release.noise_field == "algorithm.privacy.noise_multiplier"
    assert SampleLevelDP(noise_multiplier=0.0).planned_events() == []  # σ = 0 is not private: nothing charged
    alg = FedAvg(lr=1.0, privacy=mechanism)
    assert alg.planned_dp_events(0, 100) == mechanism.planned_events() and alg.local_steps == 3
    assert alg.required_callbacks == ("callbacks.RDPAccounting",) and FedAvg().required_callbacks == ()
    assert FedAvg().planned_dp_events(0, 100) == [] and FedAvg().upload_privacy() == {"params": None}


@pytest.mark.parametrize("option, value", [("local_epochs", 2), ("batch_size", 32), ("local_mode", "poisson_batch"),
                                           ("sample_rate", 0.3)])
def test_a_private_run_refuses_the_options_of_the_non_private_loop(option, value):
    with pytest.raises(ConfigError, match=rf"algorithm.{option} set the non-private local loop; with algorithm.privacy"):
        FedAvg(lr=1.0, privacy=SampleLevelDP(), **{option: value})


@pytest.mark.parametrize("name", ["FedFDP", "FedFDPFairAgg", "DPFedAvgFairAgg", "DPFedAvgAdaClip", "ALIDPFL",
                                  "DPFedAvgPriorCorrection", "DPFedAvgFineTune"])
def test_an_algorithm_that_is_private_by_definition_refuses_to_run_without_a_mechanism(name):
    with pytest.raises(ConfigError, match=rf"{name} is private: algorithm.privacy must be a fedfdp.privacy.SampleLevelDP"):
        getattr(algorithms, name)()


def test_a_mechanism_the_algorithm_cannot_use_is_refused():
    class Other(PrivacyMechanism):
        unit = "client"

    with pytest.raises(ConfigError, match="algorithm.privacy of FedProx must be fedfdp.privacy.SampleLevelDP, ClientLevelDP or null"):
        algorithms.FedProx(privacy=Other())  # type: ignore[arg-type]


def _saved_configs() -> list[Path]:
    return sorted((REPO / "docs" / "complete_runs").rglob("config.yaml"))


def test_every_config_a_committed_run_saved_reads_as_an_algorithm_of_today():
    paths = _saved_configs()
    assert len(paths) > 100
    old = clustered_old = 0
    for path in paths:
        saved = yaml.safe_load(path.read_text())
        node = saved["model"]["algorithm"]
        old += node["class_path"].rsplit(".", 1)[-1] in TWINS
        today = upgrade_config(saved)["model"]["algorithm"]
        assert upgrade_config(upgrade_config(saved)) == upgrade_config(saved), path  # idempotent
        alg = _instantiate(today)
        mechanism = {k: v for k, v in (node.get("init_args") or {}).items() if k in MECHANISM_OPTIONS}
        if isinstance(alg, FedAvg) and alg.privacy is not None and "privacy" not in (node.get("init_args") or {}):
            for key, value in mechanism.items():  # the options the run trained with, now the mechanism's
                assert getattr(alg.privacy, key) == value, (path, key)
            assert alg.lr == node["init_args"].get("lr", 1.0), path  # the twins' default lr stays the run's
        if isinstance(alg, ClusteredDPFL) and "privacy" not in (node.get("init_args") or {}):
            clustered_old += 1
            flat = {k: v for k, v in (node.get("init_args") or {}).items() if k in CLUSTERED_OPTIONS}
            assert isinstance(alg.privacy, EpochDPSGD), path
            for key in CLUSTERED_OPTIONS:  # what the run trained with (given or the unchanged default)
                assert getattr(alg.privacy, key) == flat.get(key, getattr(EpochDPSGD(), key)), (path, key)
    assert old > 50  # the old spelling is really exercised
    assert clustered_old > 10  # the clustered family's runs too (RC-DPFL's tables)


def test_a_clustered_config_of_the_old_spelling_moves_its_dp_sgd_options_into_the_mechanism():
    old = {"model": {"algorithm": {"class_path": "fedfdp.algorithms.RCDPFL", "init_args": {
        "num_clusters": 4, "lr": 0.005, "batch_size": 32, "max_grad_norm": 1.0, "noise_multiplier": None,
        "selection": "loss"}}}}
    node = upgrade_config(old)["model"]["algorithm"]
    assert node == {"class_path": "fedfdp.algorithms.RCDPFL", "init_args": {
        "num_clusters": 4, "lr": 0.005, "selection": "loss", "privacy": {
            "class_path": "fedfdp.privacy.EpochDPSGD",
            "init_args": {"batch_size": 32, "max_grad_norm": 1.0, "noise_multiplier": None}}}}
    bare = upgrade_config({"model": {"algorithm": {"class_path": "fedfdp.algorithms.LocalDPSGD"}}})
    assert bare["model"]["algorithm"]["init_args"] == {"privacy": {"class_path": "fedfdp.privacy.EpochDPSGD",
                                                                   "init_args": {}}}
    today = upgrade_config(old)
    assert upgrade_config(today) is today


def test_a_config_of_today_is_left_as_it_is_even_with_the_non_private_rate_written_out():
    saved = {"model": {"algorithm": {"class_path": "fedfdp.algorithms.FedAvg", "init_args": {
        "lr": 1.0, "sample_rate": 0.05, "privacy": {"class_path": "fedfdp.privacy.SampleLevelDP",
                                                    "init_args": {"sample_rate": 0.2}}}}}}
    assert upgrade_config(saved) is saved


def test_an_old_spelling_override_onto_a_config_of_today_moves_into_the_mechanism():
    config = {"model": {"algorithm": {"class_path": "fedfdp.algorithms.FedProx", "init_args": {
        "mu": 0.1, "noise_multiplier": 3.0, "privacy": {"class_path": "fedfdp.privacy.SampleLevelDP",
                                                        "init_args": {"noise_multiplier": 1.0}}}}}}
    node = upgrade_config(config)["model"]["algorithm"]
    assert node["init_args"] == {"mu": 0.1, "privacy": {"class_path": "fedfdp.privacy.SampleLevelDP",
                                                         "init_args": {"noise_multiplier": 3.0}}}
    assert upgrade_key("model.algorithm.init_args.max_grad_norm") == \
        "model.algorithm.init_args.privacy.init_args.max_grad_norm"
    assert upgrade_key("model.algorithm.init_args.mu") == "model.algorithm.init_args.mu"
