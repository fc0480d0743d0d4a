"""The Flower deployment over real processes (``flower`` marker): a real ``flower-superlink`` and three
``flower-supernode`` processes on 127.0.0.1 run ``flwr run examples/flower_app`` for 3 rounds of
tiny synthetic data.

FedFDP, DP-SCAFFOLD (server state and client state on the nodes) and DP-Ditto (personal models
evaluated on the nodes) give the simulation's global model (within 1e-6), every client's
evaluation and every client's ε; with ``--flower-all-algorithms`` every registered algorithm does
(tests/algorithm_cases.py). On a TLS SuperLink with SuperNode authentication an unregistered node
is rejected, a client refuses the round that would exceed its own target ε, and a SuperNode
SIGKILLed mid-round leaves the round to the others with no ledger charged for the release it
never made. A SuperNode killed after round 1 of 3 and restarted with the same partition comes
back under a new node id and trains again from round 3; summary.json lists round 2 as missed.
The connection preflight names a TLS/insecure mismatch in one line.
"""

from __future__ import annotations

import json
import math
import time

import pytest

flwr = pytest.importorskip("flwr", reason="the flower extra is not installed (pip install -e '.[flower]')")

import torch  # noqa: E402

from fedfdp.flower.node_ledger import NodeLedger, ledger_path  # noqa: E402
from fedfdp.flower.server_app import DEPLOYMENT_RECORD  # noqa: E402
from fedfdp.privacy.ledger_file import LedgerFile  # noqa: E402
from tests.algorithm_cases import ALL_CASES, algorithm_config  # noqa: E402
from tests.flower_harness import CONFIGS, OVERRIDES, ROUNDS, TIGHT_TARGET, Deployment, client_epsilons, \
    global_model, max_relative_difference, node_config, simulate, tools_missing, upload_rows  # noqa: E402

pytestmark = pytest.mark.slow  # real SuperLink and SuperNode processes: minutes a test


# ---- real SuperLink and SuperNodes --------------------------------------------------------------
@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """An insecure SuperLink and 3 SuperNodes with seeded noise (the equivalence), stopped afterwards.

    A node's ledger spans every run on it (its data's budget), so the nodes' own target is set far
    above what the module's runs spend together: each run is held to its config's target by the server."""
    root = tmp_path_factory.mktemp("flower")
    deployment = Deployment(root)
    try:
        deployment.start_seeded(3, target_epsilon=1000.0)
        yield deployment
    finally:
        deployment.stop()


#: in every test run: FedFDP (DP-FedAvg plus the loss release), SCAFFOLD's server and client state,
#: Ditto's personal models; with ``--flower-all-algorithms`` every algorithm's tiny config too
#: (tests/algorithm_cases.py; every algorithm runs over the in-process grid in every test run:
#: tests/flower/test_flower_algorithms.py)
#: FinP's curvature step (power iterations of Hessian-vector products, on the node) amplifies float32
#: rounding differences between the node's process and the simulation's: measured 6.3e-6 relative
#: over real processes (its evaluation equal, its loss within 2e-8); the in-process grid holds 1e-6
MODEL_TOLERANCE = {"FinP": 2e-5}
DEPLOYED = ["fedfdp", "dpscaffold", "dpditto",
            *(pytest.param(name, marks=pytest.mark.flower_all) for name in sorted(ALL_CASES))]


@pytest.mark.flower
@pytest.mark.parametrize("name", DEPLOYED)
def test_flower_deployment_equals_simulation(federation, name, tmp_path):
    """3 rounds through a real SuperLink + 3 SuperNodes: the simulation's global model, every client's
    evaluation (personal and cluster models: on their nodes) and ε."""
    config = CONFIGS[name] if name in CONFIGS else algorithm_config(name, tmp_path)
    run_dir = tmp_path / "flower"
    run = federation.run_app(f"config='{config}' overrides='{OVERRIDES}' run-dir='{run_dir}' "
                             f"round-timeout=300.0")
    assert run.status == "finished:completed", run.output[-4000:]
    sim = simulate(config, tmp_path / "sim")
    difference = max_relative_difference(global_model(sim), global_model(run_dir))
    assert difference <= MODEL_TOLERANCE.get(name, 1e-6), difference
    nodes = [e for c in range(3) for e in LedgerFile(ledger_path(federation.root / "ledgers", c)).read()]
    flower_eps = client_epsilons(nodes, run=run.run_id)
    private = (sim / "privacy_ledger.jsonl").is_file()  # the non-DP algorithms charge nothing
    sim_eps = client_epsilons(LedgerFile(sim / "privacy_ledger.jsonl").read()) if private else {}
    assert flower_eps.keys() == sim_eps.keys() == ({0, 1, 2} if private else set())
    assert all(flower_eps[c] == pytest.approx(sim_eps[c], rel=1e-12) for c in sim_eps)
    summary, sim_summary = (json.loads((d / "summary.json").read_text()) for d in (run_dir, sim))
    if private:
        assert summary["epsilon"] == pytest.approx(sim_summary["epsilon"], rel=1e-12)
    else:
        assert summary.get("epsilon") is None and sim_summary.get("epsilon") is None
    for key in ("accuracy", "accuracy_worst", "accuracy_std", "mean_loss"):  # every client's evaluated model
        assert summary["final"][key] == pytest.approx(sim_summary["final"][key], rel=1e-5, abs=1e-7), key
    (federation.root / f"equivalence_{name}.json").write_text(json.dumps(
        {"max_relative_difference": difference, "epsilon_flower": flower_eps, "epsilon_simulation": sim_eps,
         "flower_seconds": run.seconds}))


@pytest.mark.flower
def test_a_client_level_deployment_equals_the_simulation(federation, tmp_path):
    """Client-level DP over a real SuperLink and 3 SuperNodes: the server draws the Poisson cohort, asks
    only the sampled nodes, clips, adds the noise and charges the population's ledger; 3 rounds give the
    simulation's model and client-level ε, and no node's ledger holds a charge of the run."""
    config = CONFIGS["client_dp"]
    run_dir = tmp_path / "flower"
    run = federation.run_app(f"config='{config}' overrides='{OVERRIDES}' run-dir='{run_dir}' round-timeout=300.0")
    assert run.status == "finished:completed", run.output[-4000:]
    sim = simulate(config, tmp_path / "sim")
    assert max_relative_difference(global_model(sim), global_model(run_dir)) <= 1e-6
    summary, sim_summary = (json.loads((d / "summary.json").read_text()) for d in (run_dir, sim))
    assert summary["epsilon_unit"] == "client" and summary["privacy"]["client"] == sim_summary["privacy"]["client"]
    server = LedgerFile(run_dir / "privacy_ledger.jsonl").read()
    assert [e.round for e in server] == list(range(ROUNDS)) and {e.client for e in server} == {-1}
    nodes = [e for c in range(3) for e in LedgerFile(ledger_path(federation.root / "ledgers", c)).read()]
    assert not [e for e in nodes if e.run == run.run_id]


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    """A TLS SuperLink with SuperNode authentication and 3 registered nodes (client 2 with a tight target)."""
    missing = tools_missing()
    if missing:
        pytest.skip(f"needs {', '.join(missing)} to make certificates and keys")
    root = tmp_path_factory.mktemp("flower_tls")
    deployment = Deployment(root, tls=True, auth=True)
    try:
        deployment.start_superlink()
        for cid in range(3):
            key = deployment.make_key(f"node{cid}")
            deployment.register(key)
            target = {"target_epsilon": TIGHT_TARGET} if cid == 2 else {}
            deployment.start_supernode(f"node{cid}", node_config(partition_id=cid, num_partitions=3,
                                                                 ledger_dir=str(root / "ledgers"), secure_rng=False,
                                                                 **target), key=key)
        yield deployment
    finally:
        deployment.stop()


@pytest.mark.flower
def test_unregistered_or_keyless_supernode_is_rejected(secure):
    rogue = secure.start_supernode("rogue", node_config(partition_id=0, num_partitions=3), key=secure.make_key("rogue"))
    keyless = secure.start_supernode("keyless", node_config(partition_id=0, num_partitions=3))
    for name, proc in (("rogue", rogue), ("keyless", keyless)):  # Flower's exit code 305; the process exits 1
        assert proc.wait(timeout=120) != 0 and "Exit Code: 305" in secure.log(name), secure.log(name)[-2000:]
    assert "Failed to activate SuperNode" in secure.log("rogue")
    assert "must be registered" in secure.log("keyless")


@pytest.fixture(scope="module")
def troubled_run(secure, tmp_path_factory):
    """FedFDP over TLS for 3 rounds: client 2 refuses round 3; client 1's SuperNode is SIGKILLed in round 2."""
    import threading

    run_dir = tmp_path_factory.mktemp("troubled") / "run"
    ledger1 = ledger_path(secure.root / "ledgers", 1)
    result: dict = {}

    def kill_in_round_two() -> None:
        """Once client 1 has charged round 1, SIGKILL its node as soon as its next ClientApp starts."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (ledger1.exists() and len(ledger1.read_text().splitlines()) >= 2):
            time.sleep(0.05)
        before = set(secure.processes_in_group("node1", "flwr-clientapp"))
        while time.monotonic() < deadline:
            if set(secure.processes_in_group("node1", "flwr-clientapp")) - before:
                secure.kill_group("node1")
                result["killed"] = True
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_in_round_two, daemon=True)
    killer.start()
    result["run"] = secure.run_app(f"config='{CONFIGS['fedfdp']}' overrides='{OVERRIDES}' run-dir='{run_dir}' "
                                   f"round-timeout=300.0 straggler-timeout=45.0")
    killer.join(timeout=5)
    result["run_dir"] = run_dir
    return result


@pytest.mark.flower
def test_tls_run_goes_on_past_a_refusal(troubled_run, secure):
    run, run_dir = troubled_run["run"], troubled_run["run_dir"]
    assert run.status == "finished:completed", run.output[-4000:]
    assert "client 2 refuses: this round would take its epsilon to 3.9717, over its target 3.7" in run.output
    own = NodeLedger(secure.root / "ledgers", 2, target_epsilon=None)
    assert sorted({e.round for e in own.entries}) == [0, 1] and own.epsilon() <= TIGHT_TARGET
    record = json.loads((run_dir / DEPLOYMENT_RECORD).read_text())["clients"]
    assert record["2"]["refused_rounds"] == [3]
    assert record["2"]["epsilon_server_view"] == pytest.approx(own.epsilon(), rel=1e-12)
    assert json.loads((run_dir / "summary.json").read_text())["rounds_run"] == ROUNDS


@pytest.mark.flower
def test_killed_supernode_leaves_the_round_to_the_others_and_its_ledger_uncharged(troubled_run, secure):
    run, run_dir = troubled_run["run"], troubled_run["run_dir"]
    assert troubled_run.get("killed"), "client 1's SuperNode was not killed during round 2"
    assert run.status == "finished:completed", run.output[-4000:]
    own = NodeLedger(secure.root / "ledgers", 1, target_epsilon=None)
    assert sorted({e.round for e in own.entries}) == [0]  # round 2 was never released, never charged
    uploaded = [(float(r["clients_uploaded"]), float(r["clients_refused"]), float(r["clients_missing"]))
                for r in upload_rows(run_dir)]
    assert uploaded == [(3, 0, 0), (2, 0, 1), (1, 1, 1)]
    record = json.loads((run_dir / DEPLOYMENT_RECORD).read_text())["clients"]
    assert record["1"]["dropped"] is True
    assert record["1"]["epsilon_server_view"] == pytest.approx(own.epsilon(), rel=1e-12)
    model = global_model(run_dir)
    assert all(bool(torch.isfinite(v).all()) for v in model.values())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert not math.isnan(summary["final"]["accuracy"])
    assert summary["status"] == "completed_with_missing_clients"  # never restarted: out of rounds 2-3 and the evaluation
    assert summary["missing_clients"] == {"1": [2, 3], "2": [3]} and summary["evaluated_clients"] == [0, 2]


# ---- a SuperNode killed and restarted for the same partition takes its client back ------------------
KILL_AFTER = 1  # of ROUNDS (3): client 1 misses round 2 and is back for round 3


@pytest.mark.flower
def test_a_restarted_supernode_takes_its_client_back_and_the_run_says_what_it_missed(federation, tmp_path):
    """DP-SCAFFOLD over 3 real SuperNodes for 3 rounds: client 1's SuperNode is SIGKILLed as round 2 reaches it
    (after round 1) and restarted 5 s later with the same node config (partition, ledger and state files):
    it comes back under a new node id, misses round 2 only, trains round 3 from its state after round 1
    (its control variate), and summary.json says so (status completed_with_missing_clients,
    missing_clients {"1": [2]})."""
    import threading

    ledger1 = ledger_path(federation.root / "ledgers", 1)
    charged = len(ledger1.read_text().splitlines()) if ledger1.exists() else 0  # earlier runs on this node
    config1 = node_config(partition_id=1, num_partitions=3, ledger_dir=str(federation.root / "ledgers"),
                          secure_rng=False, target_epsilon=1000.0)
    events: dict = {}

    def kill_and_restart() -> None:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and (not ledger1.exists()
                                               or len(ledger1.read_text().splitlines()) < charged + KILL_AFTER):
            time.sleep(0.05)  # one release per round in the tiny DP-SCAFFOLD config
        before = set(federation.processes_in_group("node1", "flwr-clientapp"))
        while time.monotonic() < deadline:
            if set(federation.processes_in_group("node1", "flwr-clientapp")) - before:
                federation.kill_group("node1")
                events["killed"] = time.monotonic()
                time.sleep(5.0)
                federation.start_supernode("node1-restarted", config1)
                events["restarted"] = time.monotonic()
                return
            time.sleep(0.02)

    run_dir = tmp_path / "run"
    thread = threading.Thread(target=kill_and_restart, daemon=True)
    thread.start()
    run = federation.run_app(f"config='{CONFIGS['dpscaffold']}' overrides='{OVERRIDES}' run-dir='{run_dir}' "
                             f"round-timeout=300.0 straggler-timeout=45.0")
    thread.join(timeout=30)
    assert "killed" in events and "restarted" in events, "client 1's SuperNode was not killed and restarted"
    assert run.status == "finished:completed", run.output[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed_with_missing_clients", summary["status"]
    assert summary["missing_clients"] == {"1": [KILL_AFTER + 1]} and summary["refused_clients"] == {}
    assert summary["evaluated_clients"] == [0, 1, 2] and summary["rounds_run"] == ROUNDS
    uploaded = [float(r["clients_uploaded"]) for r in upload_rows(run_dir)]
    assert uploaded == [3, 2, 3]
    own = [e for e in LedgerFile(ledger1).read() if e.run == run.run_id]
    assert [e.round for e in own] == [0, 2]  # round 2 never released, round 3 on the restarted node
    record = json.loads((run_dir / DEPLOYMENT_RECORD).read_text())["clients"]["1"]
    assert len(record["node_ids"]) == 2 and record["node_id"] == record["node_ids"][1] != record["node_ids"][0]
    assert record["missed_rounds"] == [KILL_AFTER + 1] and record["dropped"] is False
    assert "client 1 left out of round 2 " in (run_dir / "report.md").read_text()
    (federation.root / "restart.json").write_text(json.dumps({"flower_seconds": run.seconds}))


# ---- the connection preflight: a TLS/insecure mismatch named in one line, in seconds ---------------
@pytest.mark.flower
def test_preflight_names_a_tls_mismatch_against_real_superlinks(federation, secure, capsys):
    from fedfdp.flower.preflight import main as preflight

    plain, tls = f"127.0.0.1:{federation.port}", f"127.0.0.1:{secure.port}"
    ca = str(secure.certs / "ca.crt")
    start = time.monotonic()
    assert preflight(["--superlink", tls, "--insecure"]) == 2
    assert preflight(["--superlink", plain, "--root-certificates", ca]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "serves TLS, but the SuperNode would connect with --insecure" in err[0], err
    assert "serves plaintext" in err[1], err
    assert preflight(["--superlink", tls, "--root-certificates", ca]) == 0
    assert preflight(["--superlink", plain, "--insecure"]) == 0
    assert time.monotonic() - start < 30


def test_preflight_without_a_superlink_or_with_both_modes_is_one_line(capsys):
    from fedfdp.flower.preflight import main as preflight
    from tests.flower_harness import free_port

    assert preflight(["--superlink", f"127.0.0.1:{free_port()}", "--insecure"]) == 2
    assert preflight(["--superlink", "127.0.0.1:1", "--insecure", "--root-certificates", "ca.crt"]) == 2
    assert preflight(["--superlink", "nohostport", "--insecure"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err), err
    assert "nothing answers at" in err[0] and "exactly one of" in err[1] and "HOST:PORT" in err[2]
