"""Several processes (Lightning DDP launcher, gloo on CPU) give the single process's model and ε."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from callbacks import NoisyLossReporting, RDPAccounting, SourceInferenceAudit
from fedfdp.algorithms import FedFDP, Scaffold
from fedfdp.distributed import FederatedDDPStrategy, gather_updates, rank_and_world
from fedfdp.errors import ConfigError
from fedfdp.plan import check_distributed
from fedfdp.privacy import SampleLevelDP
from tests.conftest import REPO
from tests.helpers import tiny_client

TINY = str(REPO / "tests" / "configs" / "tiny_fedfdp.yaml")


def _fit(run_dir, *extra: str) -> dict:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("FEDFDP_RUN_DIR", None)
    args = [sys.executable, "-m", "fedfdp.fit", "--config", TINY, "--run_dir", str(run_dir),
            "--model.num_rounds", "4", "--data.init_args.num_clients", "5", *extra]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    model = {k: v for k, v in ckpt["state_dict"].items() if k.startswith("global_model.")}
    return {"model": model, "summary": json.loads((run_dir / "summary.json").read_text()),
            "accounting": ckpt["callbacks"]["RDPAccounting"], "bounds": ckpt["callbacks"]["NoisyLossReporting"]}


@pytest.mark.slow
def test_two_processes_match_one_process_model_and_epsilon(tmp_path):
    """5 clients on 2 gloo processes (3 + 2 per round): same global model, ε, ledgers and loss bounds."""
    single = _fit(tmp_path / "single")
    multi = _fit(tmp_path / "ddp", "--trainer.devices", "2", "--trainer.strategy", "federated_ddp")
    assert single["model"].keys() == multi["model"].keys()
    for key, value in single["model"].items():
        torch.testing.assert_close(multi["model"][key], value, rtol=1e-5, atol=1e-6)
    assert multi["summary"]["epsilon"] == pytest.approx(single["summary"]["epsilon"], rel=1e-12)
    assert multi["accounting"] == single["accounting"]  # every client's full ledger history
    bounds, ddp_bounds = single["bounds"]["bounds"], multi["bounds"]["bounds"]
    assert bounds.keys() == ddp_bounds.keys() and len(bounds) == 5
    assert all(ddp_bounds[c] == pytest.approx(bounds[c], rel=1e-6, abs=1e-9) for c in bounds)
    assert multi["summary"]["final"]["accuracy"] == pytest.approx(single["summary"]["final"]["accuracy"])
    assert multi["summary"]["clients"]["accuracy"] == pytest.approx(single["summary"]["clients"]["accuracy"])


def _federation_with(strategy, world_size: int, algorithm, callbacks):
    from fedfdp import Federation

    fed = Federation(tiny_client(), algorithm, num_rounds=1)
    fed._trainer = SimpleNamespace(world_size=world_size, strategy=strategy)  # only what the check reads
    return fed, callbacks


@pytest.mark.parametrize("strategy, algorithm, callbacks, message", [
    (DDPStrategy(), FedFDP(privacy=SampleLevelDP()), [], "trainer.strategy must be 'federated_ddp'"),
    (FederatedDDPStrategy(), Scaffold(lr=0.1, batch_size=8), [], "Scaffold keeps per-client state"),
    (FederatedDDPStrategy(), FedFDP(privacy=SampleLevelDP()), [SourceInferenceAudit()],
     "SourceInferenceAudit cannot run"),
])
def test_multi_process_configs_that_would_be_wrong_are_refused(strategy, algorithm, callbacks, message):
    fed, cbs = _federation_with(strategy, 2, algorithm, callbacks)
    with pytest.raises(ConfigError, match=message):
        check_distributed(fed.trainer, fed.algorithm, fed.client, cbs)


def test_single_process_needs_no_check_and_gather_is_identity():
    fed, cbs = _federation_with(SingleDeviceStrategy("cpu"), 1, FedFDP(privacy=SampleLevelDP()),
                                [NoisyLossReporting(), RDPAccounting()])
    check_distributed(fed.trainer, fed.algorithm, fed.client, cbs)
    assert rank_and_world() == (0, 1)
    updates = [object(), object()]
    assert gather_updates(updates) == updates
