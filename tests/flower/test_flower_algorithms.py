"""Every algorithm deploys: its client state kept on the client's node, its run equal to the simulation.

For each deployable algorithm, a 3-round run of the tiny synthetic config through the Flower
server strategy and the ClientApp (over :class:`tests.flower_harness.InProcessGrid`, which hands
each message to the ClientApp as a SuperNode would) equals the simulation: the same global model,
the same per-client evaluation (personal and cluster models evaluated on the nodes) and the same
ε per client. Every node restarts before the last round (its ``context.state`` is gone), so the
last round continues from the state files alone; the rounds before it from ``context.state``.
Over real processes (``tests/flower/test_flower_deployment.py``, ``flower`` marker): FedFDP, DP-SCAFFOLD and DP-Ditto
in every test run, every algorithm with ``pytest --flower-all-algorithms -m flower``.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("flwr", reason="the flower extra is not installed (pip install -e '.[flower]')")

import torch  # noqa: E402

from fedfdp.algorithms import REGISTRY, load_all  # noqa: E402
from fedfdp.errors import ConfigError  # noqa: E402
from fedfdp.fit import main as fit_main  # noqa: E402
from fedfdp.flower.node_ledger import ledger_path  # noqa: E402
from fedfdp.flower.node_state import ClientStateError, NodeStateFile, state_path  # noqa: E402
from fedfdp.flower.server_app import ServerSettings, run_server  # noqa: E402
from fedfdp.flower.strategy import check_deployable  # noqa: E402
from fedfdp.privacy.ledger_file import LedgerFile  # noqa: E402
from tests.algorithm_cases import ALL_CASES, CASES, NOT_DEPLOYABLE, algorithm_config  # noqa: E402
from tests.flower_harness import InProcessGrid, client_epsilons, global_model, grid_nodes  # noqa: E402

ROUNDS = 3
#: evaluated once, at the end (each evaluation is one more message per node)
OVERRIDES = f"--model.num_rounds {ROUNDS} --model.eval_every {ROUNDS} --wandb disabled"


def test_every_algorithm_is_deployable_or_says_why():
    load_all()
    import fedfdp.algorithms as algorithms

    names = {n for n in REGISTRY if n not in ("Algorithm", "ClientStateStore")}
    assert names == set(CASES) | NOT_DEPLOYABLE, "a new algorithm needs a case here"
    refused = {n for n in names if getattr(algorithms, n).deploy_refusal is not None}
    assert refused == NOT_DEPLOYABLE


def test_an_algorithm_can_refuse_deployment_in_one_line():
    from fedfdp.algorithms import FedAvg
    from fedfdp.privacy import SampleLevelDP

    class NotOnNodes(FedAvg):  # DP-FedAvg: FedAvg with privacy
        deploy_refusal = "needs every client's data on the server"

    with pytest.raises(ConfigError, match="NotOnNodes cannot run in a Flower deployment: it needs every") as err:
        check_deployable(NotOnNodes(lr=1.0, privacy=SampleLevelDP()), [])
    assert "\n" not in str(err.value)


def _simulated_and_deployed(config, tmp_path):
    """``(simulation run dir, deployment run dir)`` of ``config``: ROUNDS rounds simulated, and deployed over
    the in-process grid with every node restarted before the last round (node ledgers in ``tmp_path/ledgers``)."""
    sim = tmp_path / "sim"
    assert fit_main(["--config", str(config), *OVERRIDES.split(), "--run_dir", str(sim)]) == 0
    settings = ServerSettings.from_run_config({"config": str(config), "overrides": OVERRIDES,
                                               "run-dir": str(tmp_path / "flower")})
    grid = InProcessGrid(grid_nodes(tmp_path / "ledgers"), restart_before={ROUNDS - 1})
    return sim, run_server(grid, settings)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_deployed_algorithm_equals_simulation(name, tmp_path):
    """3 rounds deployed (nodes restarted before the last) = 3 rounds simulated: model, evaluation, ε."""
    ledgers = tmp_path / "ledgers"
    sim, run_dir = _simulated_and_deployed(algorithm_config(name, tmp_path), tmp_path)
    deployed, simulated = global_model(run_dir), global_model(sim)
    assert deployed.keys() == simulated.keys()
    for key in simulated:
        torch.testing.assert_close(deployed[key], simulated[key], rtol=1e-6, atol=1e-7, msg=key)
    flower_summary = json.loads((run_dir / "summary.json").read_text())
    sim_summary = json.loads((sim / "summary.json").read_text())
    for key in ("accuracy", "accuracy_mean", "accuracy_worst", "accuracy_std", "mean_loss"):  # every client's model
        assert flower_summary["final"][key] == pytest.approx(sim_summary["final"][key], rel=1e-5, abs=1e-7), key
    if (sim / "privacy_ledger.jsonl").is_file():
        nodes = [e for c in range(3) for e in LedgerFile(ledger_path(ledgers, c)).read()]
        flower_eps, sim_eps = client_epsilons(nodes), client_epsilons(LedgerFile(sim / "privacy_ledger.jsonl").read())
        assert flower_eps.keys() == sim_eps.keys() and all(
            flower_eps[c] == pytest.approx(sim_eps[c], rel=1e-12) for c in sim_eps)
        sim_lines = LedgerFile(sim / "privacy_ledger.jsonl").read()  # the unit and models each event covers
        assert {(e.unit, e.models) for e in nodes} == {(e.unit, e.models) for e in sim_lines} == {
            ("record", sim_summary["privacy"]["record"]["models"])}
    states = sorted(p.name for p in ledgers.glob("client_state-*.pt"))
    assert len(states) == 3, states  # one state file per client, beside its ledger


def test_client_state_file_keeps_the_last_rounds_and_refuses_a_state_it_lacks(tmp_path):
    store = NodeStateFile(tmp_path, "run1", 2)
    assert store.load(-1) == {}
    for r in range(6):
        store.save(r, {"algo/c": torch.full((3,), float(r))})
    assert store.rounds() == [2, 3, 4, 5]
    assert torch.equal(store.load(4)["algo/c"], torch.full((3,), 4.0))
    store.save(3, {"algo/c": torch.zeros(3)})  # a replayed round 4 (after a resume) drops the later states
    assert store.rounds() == [2, 3]
    with pytest.raises(ClientStateError, match=r"after round 5, but this node holds rounds \[3, 4\]") as err:
        store.load(4)
    assert "\n" not in str(err.value)
    with pytest.raises(ClientStateError, match="holds no state"):
        NodeStateFile(tmp_path, "run2", 2).load(0)
    state_path(tmp_path, "run1", 0).write_bytes(state_path(tmp_path, "run1", 2).read_bytes())
    with pytest.raises(ClientStateError, match="is not client 0's state of run run1"):
        NodeStateFile(tmp_path, "run1", 0).load(2)
    assert not list(tmp_path.glob("*.tmp"))  # atomic writes leave no temporary file


@pytest.mark.slow
def test_a_client_level_deployment_equals_the_simulation(tmp_path):
    """Client-level DP deployed: the server draws the Poisson cohort, clips, adds the noise and charges the
    population's ledger; 3 rounds (nodes restarted before the last) give the simulation's model and ε,
    and no node's ledger holds a client-level charge."""
    from tests.conftest import REPO

    ledgers = tmp_path / "ledgers"
    sim, run_dir = _simulated_and_deployed(REPO / "tests" / "configs" / "tiny_client_dp.yaml", tmp_path)
    deployed, simulated = global_model(run_dir), global_model(sim)
    for key in simulated:
        torch.testing.assert_close(deployed[key], simulated[key], rtol=1e-6, atol=1e-7, msg=key)
    flower_summary, sim_summary = (json.loads((d / "summary.json").read_text()) for d in (run_dir, sim))
    assert flower_summary["epsilon_unit"] == sim_summary["epsilon_unit"] == "client"
    assert flower_summary["privacy"]["client"] == sim_summary["privacy"]["client"]
    assert flower_summary["privacy"]["client"]["rounds"] == ROUNDS
    server_ledger = LedgerFile(run_dir / "privacy_ledger.jsonl").read()
    assert [e.round for e in server_ledger] == list(range(ROUNDS)) and {e.client for e in server_ledger} == {-1}
    assert not [e for c in range(3) for e in LedgerFile(ledger_path(ledgers, c)).read()]  # nothing per node
