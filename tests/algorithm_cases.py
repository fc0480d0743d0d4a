"""One tiny config per algorithm, for the deployment tests (in-process grid and real processes).

:data:`CASES` maps every registered algorithm to the tiny synthetic config it deploys with:
``tests/configs/tiny_dpfedavg.yaml`` with the algorithm, its ``init_args`` and its callbacks
swapped in (or a tiny config file as it is). A new algorithm needs a case here
(``tests/flower/test_flower_algorithms.py`` checks it).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.conftest import REPO

CONFIGS = REPO / "tests" / "configs"
DP = {"lr": 1.0, "sample_rate": 0.2, "max_grad_norm": 1.0, "noise_multiplier": 1.0}
PLAIN = {"lr": 0.1, "batch_size": 32}
ACCOUNTING = {"class_path": "callbacks.RDPAccounting", "init_args": {"target_epsilon": 10.0, "delta": 1.0e-5}}
LOSS = {"class_path": "callbacks.NoisyLossReporting", "init_args": {"loss_bound": 2.5, "noise_multiplier": 5.0}}
GLOBAL_LOSS = {"class_path": "callbacks.NoisyGlobalLossReporting",
               "init_args": {"loss_bound": 2.5, "noise_multiplier": 5.0}}
FINP = {"client_reg": True, "server_agg": "ala", "curvature_samples": 16, "curvature_iters": 5}
CLUSTERED = {"num_clusters": 2, "lr": 0.1, "batch_size": 16, "max_grad_norm": 1.0, "noise_multiplier": 1.0}

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
    "DPFedAvg": "tiny_dpfedavg.yaml",
    "FedFDP": "tiny_fedfdp.yaml",
    "DPFedAvgAdaClip": "tiny_adaclip.yaml",
    "DPFinP": ({**DP, **FINP}, [ACCOUNTING]),
    "DPFedProx": ({**DP, "mu": 0.01}, [ACCOUNTING]),
    "DPScaffold": (DP, [ACCOUNTING]),
    "DPFedDyn": ({**DP, "alpha": 0.01}, [ACCOUNTING]),
    "DPDitto": ({**DP, "personal_weight": 0.1}, [ACCOUNTING]),
    "DPLocalOnly": (DP, [ACCOUNTING]),
    "DPFedAvgFineTune": ({**DP, "finetune_fraction": 0.5, "finetune_lr": 0.5}, [ACCOUNTING]),  # rounds 2, 3 fine-tune
    "DPQFFL": ({**DP, "q": 1.0}, [GLOBAL_LOSS, ACCOUNTING]),
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
NOT_DEPLOYABLE: set[str] = set()


def algorithm_config(name: str, directory: Path) -> Path:
    """The tiny config of algorithm ``name`` (written to ``directory`` unless it is a file as it is)."""
    case = CASES[name]
    if isinstance(case, str):
        return CONFIGS / case
    init_args, callbacks, *swap = case
    config = yaml.safe_load((CONFIGS / "tiny_dpfedavg.yaml").read_text())
    if swap:
        config["data"] = swap[0]["data"]
        config["model"]["client"]["init_args"]["net"] = swap[0]["net"]
    config["model"]["algorithm"] = {"class_path": f"fedfdp.algorithms.{name}", "init_args": dict(init_args)}
    config["trainer"]["callbacks"] = list(callbacks)
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path
