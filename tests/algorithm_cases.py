"""One tiny config per algorithm, for the deployment tests (in-process grid and real processes).

:data:`CASES` maps every registered algorithm to the tiny synthetic config it deploys with:
``tests/configs/tiny_dpfedavg.yaml`` with the algorithm, its ``init_args`` and its callbacks
swapped in (or a tiny config file as it is). A new algorithm needs a case here
(``tests/flower/test_flower_algorithms.py`` checks it). :data:`PRIVATE_CASES` are the algorithms
that also run privately, run with ``privacy: SampleLevelDP`` (what the retired twins DPFedProx, ...
were), named ``<algorithm>-private``; :data:`ALL_CASES` is both (what the deployment tests run).
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from tests.conftest import REPO

CONFIGS = REPO / "tests" / "configs"
#: a private algorithm's options: lr 1 (the retired twins' default, written out) and the mechanism
DP = {"lr": 1.0, "privacy": {"class_path": "fedfdp.privacy.SampleLevelDP",
                             "init_args": {"sample_rate": 0.2, "max_grad_norm": 1.0, "noise_multiplier": 1.0}}}
PLAIN = {"lr": 0.1, "batch_size": 32}
ACCOUNTING = {"class_path": "callbacks.RDPAccounting", "init_args": {"target_epsilon": 10.0, "delta": 1.0e-5}}
LOSS = {"class_path": "callbacks.NoisyLossReporting", "init_args": {"loss_bound": 2.5, "noise_multiplier": 5.0}}
GLOBAL_LOSS = {"class_path": "callbacks.NoisyGlobalLossReporting",
               "init_args": {"loss_bound": 2.5, "noise_multiplier": 5.0}}
FINP = {"client_reg": True, "server_agg": "ala", "curvature_samples": 16, "curvature_iters": 5}
CLUSTERED = {"num_clusters": 2, "lr": 0.1, "privacy": {"class_path": "fedfdp.privacy.EpochDPSGD", "init_args": {
    "batch_size": 16, "max_grad_norm": 1.0, "noise_multiplier": 1.0}}}

#: OracleCDPFL needs data that knows its true clusters: 3 digit clients in 2 rotation clusters
DIGITS = {"data": {"class_path": "datamodules.ClusteredDigitsDataModule",
                   "init_args": {"cluster_sizes": [1, 2], "shift": "rotation", "train_per_client": 60,
                                 "test_per_client": 20, "sampling": "overlap", "partition_seed": 1}},
          "net": {"class_path": "fedfdp.models.TinyCNN",
                  "init_args": {"in_channels": 1, "num_classes": 10, "image_size": 8}}}

#: algorithm → (init_args, callbacks[, data and net]); a file name instead: that tiny config as it is
CASES: dict[str, tuple | str] = {
    "FedAvg": (PLAIN, []),
    "FedProx": ({**PLAIN, "mu": 0.01}, []),
    "Scaffold": (PLAIN, []),
    "FedDyn": ({**PLAIN, "alpha": 0.01}, []),
    "Ditto": ({**PLAIN, "personal_weight": 0.1}, []),
    "LocalOnly": (PLAIN, []),
    "QFFL": ({**PLAIN, "q": 1.0}, [{"class_path": "callbacks.GlobalLossReporting"}]),
    "FedFair": ({**PLAIN, "fairness_weight": 0.1}, [{"class_path": "callbacks.LossReporting"}]),
    "FinP": ({**PLAIN, **FINP}, []),
    "FedFDP": "tiny_fedfdp.yaml",
    "DPFedAvgAdaClip": "tiny_adaclip.yaml",
    "DPFedAvgFineTune": ({**DP, "finetune_fraction": 0.5, "finetune_lr": 0.5}, [ACCOUNTING]),  # rounds 2, 3 fine-tune
    "ALIDPFL": ({**DP, "max_local_steps": 3}, [ACCOUNTING]),
    "DPFedAvgFairAgg": (DP, [LOSS, ACCOUNTING]),
    "FedFDPFairAgg": (DP, [LOSS, ACCOUNTING]),
    "ClusteredDPFL": (CLUSTERED, [ACCOUNTING]),
    "IFCA": ({**CLUSTERED, "selection_epsilon": 1.0}, [ACCOUNTING]),
    "KMCDPFL": (CLUSTERED, [ACCOUNTING]),
    "RCDPFL": (CLUSTERED, [ACCOUNTING]),
    "LocalDPSGD": (CLUSTERED, [ACCOUNTING]),
    "OracleCDPFL": (CLUSTERED, [ACCOUNTING], DIGITS),
    "DPFedAvgPriorCorrection": ({**DP, "prior_noise_multiplier": 2.0}, [ACCOUNTING]),  # a fit-start release
}
PRIVATE = "-private"
#: ``<algorithm>-private`` → the case of that algorithm with ``privacy`` (the retired twins' runs)
PRIVATE_CASES: dict[str, tuple | str] = {
    "FedAvg-private": "tiny_dpfedavg.yaml",
    "FinP-private": ({**DP, **FINP}, [ACCOUNTING]),
    "FedProx-private": ({**DP, "mu": 0.01}, [ACCOUNTING]),
    "Scaffold-private": (DP, [ACCOUNTING]),
    "FedDyn-private": ({**DP, "alpha": 0.01}, [ACCOUNTING]),
    "Ditto-private": ({**DP, "personal_weight": 0.1}, [ACCOUNTING]),
    "LocalOnly-private": (DP, [ACCOUNTING]),
    "QFFL-private": ({**DP, "q": 1.0}, [GLOBAL_LOSS, ACCOUNTING]),
}
ALL_CASES: dict[str, tuple | str] = {**CASES, **PRIVATE_CASES}
NOT_DEPLOYABLE: set[str] = set()


def algorithm_name(case: str) -> str:
    """The registered algorithm a case runs (``FedProx-private``: ``FedProx``)."""
    return case.removesuffix(PRIVATE)


def algorithm_config(name: str, directory: Path) -> Path:
    """The tiny config of case ``name`` of :data:`ALL_CASES` (written to ``directory`` unless it is a
    file as it is)."""
    case = ALL_CASES[name]
    if isinstance(case, str):
        return CONFIGS / case
    init_args, callbacks, *swap = case
    config = yaml.safe_load((CONFIGS / "tiny_dpfedavg.yaml").read_text())
    if swap:
        config["data"] = swap[0]["data"]
        config["model"]["client"]["init_args"]["net"] = swap[0]["net"]
    config["model"]["algorithm"] = {"class_path": f"fedfdp.algorithms.{algorithm_name(name)}",
                                    "init_args": copy.deepcopy(init_args)}
    config["trainer"]["callbacks"] = list(callbacks)
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path
