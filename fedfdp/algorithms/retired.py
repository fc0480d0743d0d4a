"""Configs written before ``privacy=``: the twin classes and flat DP options, read as today's spelling.

Before the privacy component, a private algorithm was a twin class (``DPFedProx``) or a DP class
that listed the mechanism's options itself (``FedFDP(sample_rate=..., noise_multiplier=...)``).
Today each is its algorithm with ``privacy: {class_path: fedfdp.privacy.SampleLevelDP, init_args:
{...}}``. :func:`upgrade_config` rewrites a config of the old spelling into the new one, with the
same run: the twin's default learning rate (1.0) is written out, since the merged classes default
to the non-private 0.1. It is applied to the configs that runs saved (a resume, a table built from
committed runs), never silently to a config a user gives: :func:`retired_message` is the one line
that refuses such a config.

The clustered family (RC-DPFL, IFCA, KM-CDPFL, the oracle and local DP-SGD baselines) listed its
local DP-SGD's options flat too; today they are ``privacy: {class_path: fedfdp.privacy.EpochDPSGD,
init_args: {batch_size, local_epochs, max_grad_norm, noise_multiplier, target_epsilon}}``, with the
same defaults, so the upgrade moves what was given and the run is the same.
"""

from __future__ import annotations

import copy
from typing import Any

#: The retired twins → the class that runs them with ``privacy`` (also :data:`fedfdp.algorithms.RETIRED`).
TWINS: dict[str, str] = {"DPFedAvg": "FedAvg", "DPFedProx": "FedProx", "DPQFFL": "QFFL", "DPScaffold": "Scaffold",
                         "DPFedDyn": "FedDyn", "DPDitto": "Ditto", "DPLocalOnly": "LocalOnly", "DPFinP": "FinP"}
#: The private classes that kept their names but no longer list the mechanism's options.
PRIVATE: frozenset[str] = frozenset({"FedFDP", "FedFDPFairAgg", "DPFedAvgFairAgg", "DPFedAvgAdaClip", "ALIDPFL",
                                     "DPFedAvgPriorCorrection", "DPFedAvgFineTune"})
#: The mechanism's options, which moved from the algorithm into ``privacy.init_args``.
MECHANISM_OPTIONS: tuple[str, ...] = ("sample_rate", "max_grad_norm", "noise_multiplier", "local_steps",
                                      "normalize_by", "normalize_constant")
#: The clustered family: always private, its local DP-SGD's options moved into ``privacy``.
CLUSTERED: frozenset[str] = frozenset({"ClusteredDPFL", "RCDPFL", "IFCA", "KMCDPFL", "OracleCDPFL", "LocalDPSGD"})
#: The clustered family's mechanism options (:class:`fedfdp.privacy.EpochDPSGD`).
CLUSTERED_OPTIONS: tuple[str, ...] = ("batch_size", "local_epochs", "max_grad_norm", "noise_multiplier",
                                      "target_epsilon")
PACKAGE = "fedfdp.algorithms."
SAMPLE_LEVEL = "fedfdp.privacy.SampleLevelDP"
EPOCH_LEVEL = "fedfdp.privacy.EpochDPSGD"


def _name(class_path: Any) -> str | None:
    if not isinstance(class_path, str):
        return None
    name = class_path.rsplit(".", 1)[-1]
    return name if class_path in (name, PACKAGE + name) or class_path.startswith("fedfdp.algorithms.") else None


def needs_upgrade(algorithm: Any) -> bool:
    """Whether an ``algorithm`` config node is of the old spelling."""
    if not isinstance(algorithm, dict):
        return False
    name = _name(algorithm.get("class_path"))
    init_args = algorithm.get("init_args") or {}
    if name in CLUSTERED:
        return not isinstance(init_args.get("privacy"), dict) or any(k in init_args for k in CLUSTERED_OPTIONS)
    return name in TWINS or (name in PRIVATE and "privacy" not in init_args) \
        or (isinstance(init_args.get("privacy"), dict) and bool(_flat_options(name, init_args)))


def _flat_options(name: str | None, init_args: dict[str, Any]) -> list[str]:
    """The mechanism's options given flat in ``init_args`` that the class does not take itself (a
    non-private FedAvg's ``sample_rate``, the rate of its ``poisson_batch`` loop, is its own)."""
    flat = [key for key in MECHANISM_OPTIONS if key in init_args]
    if not flat or name in TWINS or name in PRIVATE:
        return flat
    try:
        import importlib
        import inspect

        own = inspect.signature(getattr(importlib.import_module(PACKAGE.rstrip(".")), str(name))).parameters
    except (ImportError, AttributeError, ValueError, TypeError):
        return flat
    return [key for key in flat if key not in own]


def upgrade_algorithm(algorithm: dict[str, Any]) -> dict[str, Any]:
    """``algorithm`` in today's spelling (a copy; a node that needs nothing is returned as it is)."""
    if not needs_upgrade(algorithm):
        return algorithm
    name = _name(algorithm["class_path"])
    assert name is not None
    init_args = dict(algorithm.get("init_args") or {})
    if name in CLUSTERED:
        return {**algorithm, "init_args": _with_mechanism(init_args, EPOCH_LEVEL, CLUSTERED_OPTIONS)}
    flat = _flat_options(name, init_args)
    if name == "ALIDPFL" and "local_steps" in flat:  # ALI-DPFL chooses its own step count
        init_args.pop("local_steps")
        flat.remove("local_steps")
    if name in TWINS:
        init_args.setdefault("lr", 1.0)  # the twin's default; the merged class defaults to 0.1
        name = TWINS[name]
    return {**algorithm, "class_path": PACKAGE + name,
            "init_args": _with_mechanism(init_args, SAMPLE_LEVEL, tuple(flat))}


def _with_mechanism(init_args: dict[str, Any], class_path: str, options: tuple[str, ...]) -> dict[str, Any]:
    """``init_args`` with ``options`` given flat moved into its ``privacy`` node of ``class_path``
    (made when there is none; over a given node the flat options win, as an override would)."""
    mechanism = {key: init_args.pop(key) for key in options if key in init_args}
    given = init_args.get("privacy")
    if isinstance(given, dict):
        init_args["privacy"] = {**given, "init_args": {**(given.get("init_args") or {}), **mechanism}}
    else:
        init_args["privacy"] = {"class_path": class_path, "init_args": mechanism}
    return init_args


def upgrade_key(key: str) -> str:
    """A dotted option of the old spelling (``model.algorithm.init_args.max_grad_norm``, a stored
    search-space parameter) in today's (``model.algorithm.init_args.privacy.init_args.max_grad_norm``).
    Only for a config whose algorithm is private: a non-private ``sample_rate`` stays the algorithm's."""
    prefix = "model.algorithm.init_args."
    option = key[len(prefix):] if key.startswith(prefix) else None
    return f"{prefix}privacy.init_args.{option}" if option in MECHANISM_OPTIONS else key


def upgrade_config(config: dict[str, Any]) -> dict[str, Any]:
    """A whole config (``model.algorithm``) in today's spelling (a copy where anything changes)."""
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict) or not needs_upgrade(model.get("algorithm")):
        return config
    upgraded = copy.deepcopy(config)
    upgraded["model"]["algorithm"] = upgrade_algorithm(model["algorithm"])
    return upgraded


def retired_message(name: str) -> str:
    """The one line for a retired twin's name."""
    return (f"fedfdp.algorithms.{name} was retired: use class_path fedfdp.algorithms.{TWINS[name]} with "
            f"init_args.privacy: {{class_path: {SAMPLE_LEVEL}, init_args: {{sample_rate, max_grad_norm, "
            f"noise_multiplier, local_steps, normalize_by, normalize_constant}}}} (and lr, which defaulted to 1.0)")
