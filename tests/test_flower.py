"""The Flower deployment (fedfdp.flower): the same algorithm as the simulation, each client keeping its own budget.

Fast tests (no Flower process): the client's ledger and refusal, the node settings, what cannot be
deployed, the message encoding, and the server strategy end to end over an in-process grid that
hands each message to the ClientApp in this process.

Deployment tests (``flower`` marker): a real ``flower-superlink`` and three ``flower-supernode``
processes on 127.0.0.1 run ``flwr run examples/flower_app`` for 3 rounds of tiny synthetic data:
FedFDP, DP-SCAFFOLD (server state and client state on the nodes) and DP-Ditto (personal models
evaluated on the nodes) give the simulation's global model (within 1e-6), every client's
evaluation and every client's ε (every algorithm over the in-process grid:
``tests/test_flower_algorithms.py``); on a
TLS SuperLink with SuperNode authentication an unregistered node is rejected, a client refuses
the round that would exceed its own target ε, and a SuperNode SIGKILLed mid-round leaves the
round to the others with no ledger charged for the release it never made.
"""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path

import pytest

flwr = pytest.importorskip("flwr", reason="the flower extra is not installed (pip install -e '.[flower]')")

import torch  # noqa: E402

from callbacks import NoisyLossReporting, RDPAccounting, SourceInferenceAudit  # noqa: E402
from fedfdp.algorithms import DPDitto, DPFedAvg, DPFedAvgPriorCorrection, FedFDP, FedFDPFairAgg, Scaffold  # noqa: E402
from fedfdp.errors import ConfigError  # noqa: E402
from fedfdp.fit import main as fit_main  # noqa: E402
from fedfdp.flower import protocol  # noqa: E402
from fedfdp.flower.node import NodeClient, NodeSettings  # noqa: E402
from fedfdp.flower.node_ledger import NodeLedger, ledger_path  # noqa: E402
from fedfdp.flower.server_app import DEPLOYMENT_RECORD, ServerSettings, run_server  # noqa: E402
from fedfdp.flower.strategy import check_deployable  # noqa: E402
from fedfdp.privacy.accounting import DPEvent, epsilon_of  # noqa: E402
from fedfdp.privacy.ledger_file import LedgerFile  # noqa: E402
from fedfdp.seeding import SecureGenerator  # noqa: E402
from fedfdp.types import ClientUpdate  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.algorithm_cases import CASES, algorithm_config  # noqa: E402
from tests.flower_harness import Deployment, InProcessGrid, node_config, tools_missing  # noqa: E402

CONFIGS = {name: REPO / "tests" / "configs" / f"tiny_{name}.yaml"
           for name in ("dpfedavg", "fedfdp", "dpscaffold", "dpditto")}
ROUNDS = 3
#: a run of ROUNDS rounds, evaluated once at the end (every evaluation is one more message per node)
OVERRIDES = f"--model.num_rounds {ROUNDS} --model.eval_every 10 --wandb disabled"
MODEL = DPEvent(noise_multiplier=1.0, sample_rate=0.2)   # tiny configs: one DP-SGD step per round
LOSS = DPEvent(noise_multiplier=5.0, sample_rate=0.2)    # and FedFDP's loss release
#: between ε after 2 rounds (3.50) and after 3 rounds (3.97) of FedFDP in the tiny config
TIGHT_TARGET = 3.7


# ---- the client's ledger, settings, what deploys, messages --------------------------------------
def test_node_ledger_charges_durably_and_refuses_past_its_target(tmp_path):
    planned = [("model", MODEL), ("loss", LOSS)]
    ledger = NodeLedger(tmp_path, 2, target_epsilon=TIGHT_TARGET)
    for round_idx in range(2):
        assert ledger.refusal(planned) is None
        ledger.charge(round_idx, planned, run="r1")
    reason = ledger.refusal(planned)
    assert reason is not None and "client 2 refuses" in reason and "3.9717" in reason and "3.7" in reason
    lines = ledger_path(tmp_path, 2).read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(line)["run"] == "r1" for line in lines)
    ledger.close()
    again = NodeLedger(tmp_path, 2, target_epsilon=TIGHT_TARGET)  # a restarted node: the file is the ledger
    assert again.epsilon() == pytest.approx(epsilon_of([MODEL, LOSS] * 2, 1e-5), rel=1e-12)
    assert again.refusal(planned) == reason
    assert NodeLedger(tmp_path, 2, target_epsilon=None).refusal(planned) is None  # no budget: accounts only
    assert again.run_epsilon("other run") == 0.0


def test_node_ledger_refuses_a_file_of_another_partition(tmp_path):
    NodeLedger(tmp_path, 0, target_epsilon=None).charge(0, [("model", MODEL)], run=None)
    ledger_path(tmp_path, 0).rename(ledger_path(tmp_path, 1))
    with pytest.raises(ConfigError, match="holds releases of client 0, not of partition 1"):
        NodeLedger(tmp_path, 1, target_epsilon=None)


def test_node_settings_default_to_secure_noise_and_refuse_bad_values(tmp_path):
    settings = NodeSettings.from_node_config({"partition-id": 1, "num-partitions": 3})
    assert settings.secure_rng is True and settings.target_epsilon is None
    for config, message in [
        ({"partition-id": 3, "num-partitions": 3}, r"partition-id must be an integer in \[0, 3\), got 3"),
        ({"num-partitions": 3}, "node-config must set partition-id"),
        ({"partition-id": 0, "num-partitions": 3, "target-epsilon": -1.0}, "target-epsilon must be a number > 0"),
        ({"partition-id": 0, "num-partitions": 3, "secure-rng": "yes"}, "secure-rng must be true or false"),
        ({"partition-id": 0, "num-partitions": 3, "partition": 1}, "unknown keys"),
    ]:
        with pytest.raises(ConfigError, match=message):
            NodeSettings.from_node_config(config)


def test_secure_rng_is_the_node_default(tmp_path):
    settings = NodeSettings.from_node_config({"partition-id": 0, "num-partitions": 3, "ledger-dir": str(tmp_path)})
    node = NodeClient(CONFIGS["fedfdp"].read_text(), settings)
    assert isinstance(node.federation.generator("client", 0, 0), SecureGenerator)
    node.close()


@pytest.mark.parametrize("algorithm, callbacks, message", [
    (FedFDP(), [NoisyLossReporting(), RDPAccounting(), SourceInferenceAudit()], "SourceInferenceAudit reads every"),
])
def test_what_cannot_run_on_nodes_is_refused_with_one_line(algorithm, callbacks, message):
    with pytest.raises(ConfigError, match=message) as err:
        check_deployable(algorithm, callbacks)
    assert "\n" not in str(err.value)


def test_deployable_algorithms():
    for algorithm in (DPFedAvg(), FedFDP(), FedFDPFairAgg(), Scaffold(), DPDitto(),  # all: test_flower_algorithms
                      DPFedAvgPriorCorrection()):
        check_deployable(algorithm, [NoisyLossReporting(), RDPAccounting()])


def test_an_upload_crosses_the_wire_bit_for_bit():
    params = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    update = ClientUpdate(client_id=2, params=params, num_examples=117, dp_events=[("model", MODEL), ("loss", LOSS)],
                          reported_loss=0.123456789, diagnostics={"train_loss": 1.0})
    back = protocol.decode_train_reply(protocol.encode_update(update, epsilon=1.5))
    assert torch.equal(back.params, params) and back.dp_events == update.dp_events
    assert (back.client_id, back.num_examples, back.reported_loss) == (2, 117, 0.123456789)
    assert back.diagnostics == {}  # simulation-only diagnostics never leave the node
    refusal = protocol.decode_train_reply(protocol.encode_refusal(2, "over budget", 3.5))
    assert isinstance(refusal, protocol.Refusal) and refusal.reason == "over budget"


# ---- the server strategy over an in-process grid ------------------------------------------------
def _nodes(ledgers: Path, targets: dict[int, float] | None = None) -> dict[int, dict]:
    configs = {}
    for cid in range(3):
        config = {"partition-id": cid, "num-partitions": 3, "ledger-dir": str(ledgers), "secure-rng": False}
        if targets and cid in targets:
            config["target-epsilon"] = targets[cid]
        configs[100 + cid] = config
    return configs


def _simulate(name: str | Path, run_dir: Path) -> Path:
    config = CONFIGS[name] if isinstance(name, str) else name
    assert fit_main(["--config", str(config), *OVERRIDES.split(), "--run_dir", str(run_dir)]) == 0
    return run_dir


def _global_model(run_dir: Path) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("global_model.")}


def _max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-12)) for k in a)


def _client_epsilons(entries, run: str | None = None) -> dict[int, float]:
    chosen = [e for e in entries if run is None or e.run == run]
    return {c: epsilon_of([e.event for e in chosen if e.client == c], 1e-5) for c in sorted({e.client for e in chosen})}


def _metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv") as f:
        return [row for row in csv.DictReader(f) if row.get("clients_uploaded")]


def test_strategy_over_in_process_nodes_equals_simulation(tmp_path):
    """The server strategy and the ClientApp, without processes: the simulation's model and ε, bit for bit."""
    sim = _simulate("fedfdp", tmp_path / "sim")
    grid = InProcessGrid(_nodes(tmp_path / "ledgers"))
    settings = ServerSettings.from_run_config({"config": str(CONFIGS["fedfdp"]), "overrides": OVERRIDES,
                                               "run-dir": str(tmp_path / "flower")})
    run_dir = run_server(grid, settings)  # type: ignore[arg-type]
    assert _max_relative_difference(_global_model(sim), _global_model(run_dir)) == 0.0
    nodes = [e for c in range(3) for e in LedgerFile(ledger_path(tmp_path / "ledgers", c)).read()]
    assert _client_epsilons(nodes) == _client_epsilons(LedgerFile(sim / "privacy_ledger.jsonl").read())
    for name in ("config.yaml", "metrics.csv", "summary.json", "report.md", DEPLOYMENT_RECORD):
        assert (run_dir / name).is_file(), name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final"]["accuracy"] == json.loads((sim / "summary.json").read_text())["final"]["accuracy"]


@pytest.mark.parametrize("name", ["fedfdp", "dpditto"])
def test_a_resumed_deployment_continues_the_run(tmp_path, name):
    """ckpt-path='last' continues a deployed run to the end an uninterrupted one reaches, appending its files
    (DP-Ditto: each node continues its client's personal model from the state the checkpoint names)."""
    ledgers = tmp_path / "ledgers"

    def deploy(run_dir: Path, rounds: int, node_ledgers: Path, **extra: str) -> Path:
        overrides = OVERRIDES.replace(f"--model.num_rounds {ROUNDS}", f"--model.num_rounds {rounds}")
        settings = ServerSettings.from_run_config({"config": str(CONFIGS[name]), "run-dir": str(run_dir),
                                                   "overrides": overrides + " --checkpoint_every 1", **extra})
        return run_server(InProcessGrid(_nodes(node_ledgers)), settings)  # type: ignore[arg-type]

    whole = deploy(tmp_path / "whole", 4, tmp_path / "whole_ledgers")
    run_dir = deploy(tmp_path / "run", 2, ledgers)
    assert deploy(run_dir, 4, ledgers, **{"ckpt-path": "last"}) == run_dir
    assert _max_relative_difference(_global_model(whole), _global_model(run_dir)) == 0.0
    assert [int(r["round"]) for r in _metrics(run_dir)] == [1, 2, 3, 4]  # appended, not restarted
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_run"] == 4
    whole_final = json.loads((whole / "summary.json").read_text())["final"]
    assert [summary["final"][k] for k in ("accuracy", "accuracy_worst")] == [whole_final[k] for k in
                                                                            ("accuracy", "accuracy_worst")]
    nodes = {c: NodeLedger(ledgers, c, target_epsilon=None).epsilon() for c in range(3)}
    record = json.loads((run_dir / DEPLOYMENT_RECORD).read_text())["clients"]
    for cid in range(3):  # the server's view and each node's own ledger agree, and equal the uninterrupted run's
        assert record[str(cid)]["epsilon_server_view"] == pytest.approx(nodes[cid], rel=1e-12)
        assert nodes[cid] == pytest.approx(NodeLedger(tmp_path / "whole_ledgers", cid, target_epsilon=None).epsilon(),
                                           rel=1e-12)


def test_a_resume_without_its_run_dir_is_refused_with_one_line():
    with pytest.raises(ConfigError, match="ckpt-path continues the run in run-dir"):
        ServerSettings.from_run_config({"config": str(CONFIGS["fedfdp"]), "ckpt-path": "last"})


def test_strategy_goes_on_without_refusing_and_silent_clients(tmp_path):
    """Client 2 refuses round 3 (its own target); client 1 never answers from round 2: the others carry on."""
    ledgers = tmp_path / "ledgers"
    grid = InProcessGrid(_nodes(ledgers, targets={2: TIGHT_TARGET}), silent={101}, silent_from=1)
    settings = ServerSettings.from_run_config({"config": str(CONFIGS["fedfdp"]), "overrides": OVERRIDES,
                                               "run-dir": str(tmp_path / "flower"), "round-timeout": 1.0})
    run_dir = run_server(grid, settings)  # type: ignore[arg-type]
    rounds = {c: sorted({e.round for e in LedgerFile(ledger_path(ledgers, c)).read()}) for c in range(3)}
    assert rounds == {0: [0, 1, 2], 1: [0], 2: [0, 1]}
    uploaded = [(float(r["clients_uploaded"]), float(r["clients_refused"]), float(r["clients_missing"]))
                for r in _metrics(run_dir)]
    assert uploaded == [(3, 0, 0), (2, 0, 1), (1, 1, 1)]
    record = json.loads((run_dir / DEPLOYMENT_RECORD).read_text())["clients"]
    assert record["2"]["refused_rounds"] == [3] and record["1"]["dropped"] is True
    for cid in range(3):  # the server counted exactly what each client charged itself
        own = NodeLedger(ledgers, cid, target_epsilon=None).epsilon()
        assert record[str(cid)]["epsilon_server_view"] == pytest.approx(own, rel=1e-12)
    assert NodeLedger(ledgers, 2, target_epsilon=None).epsilon() <= TIGHT_TARGET


def test_a_lost_node_is_named_by_its_id_and_round_and_a_slow_one_as_slow(tmp_path, caplog):
    """Client 1's node dies in round 2 (the SuperLink reports it unavailable); client 2's stays connected but silent."""
    grid = InProcessGrid(_nodes(tmp_path / "ledgers"), silent={102}, lost={101}, silent_from=1)
    settings = ServerSettings.from_run_config({"config": str(CONFIGS["fedfdp"]), "overrides": OVERRIDES,
                                               "run-dir": str(tmp_path / "flower"), "round-timeout": 1.0})
    with caplog.at_level("WARNING", logger="fedfdp.flower.strategy"):
        run_dir = run_server(grid, settings)  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records]
    assert [m for m in lines if m.startswith("client 1: its SuperNode 101 was lost in round 2")], lines
    assert [m for m in lines if m.startswith("client 2 (node 102) did not answer round 2 in time")
            and "still connected" in m], lines
    record = json.loads((run_dir / DEPLOYMENT_RECORD).read_text())["clients"]
    assert record["1"]["dropped"] is True and record["2"]["dropped"] is True


def test_a_node_that_cannot_take_part_stops_the_run_with_its_reason(tmp_path):
    nodes = _nodes(tmp_path / "ledgers")
    nodes[102]["num-partitions"] = 4
    settings = ServerSettings.from_run_config({"config": str(CONFIGS["fedfdp"]), "overrides": OVERRIDES,
                                               "run-dir": str(tmp_path / "flower")})
    with pytest.raises(ConfigError, match=r"cannot take part: .*num-partitions=4 but the run's data.num_clients=3"):
        run_server(InProcessGrid(nodes), settings)  # type: ignore[arg-type]


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
#: tests/test_flower_algorithms.py)
#: FinP's curvature step (power iterations of Hessian-vector products, on the node) amplifies float32
#: rounding differences between the node's process and the simulation's: measured 6.3e-6 relative
#: over real processes (its evaluation equal, its loss within 2e-8); the in-process grid holds 1e-6
MODEL_TOLERANCE = {"FinP": 2e-5}
DEPLOYED = ["fedfdp", "dpscaffold", "dpditto",
            *(pytest.param(name, marks=pytest.mark.flower_all) for name in sorted(CASES))]


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
    sim = _simulate(config, tmp_path / "sim")
    difference = _max_relative_difference(_global_model(sim), _global_model(run_dir))
    assert difference <= MODEL_TOLERANCE.get(name, 1e-6), difference
    nodes = [e for c in range(3) for e in LedgerFile(ledger_path(federation.root / "ledgers", c)).read()]
    flower_eps = _client_epsilons(nodes, run=run.run_id)
    private = (sim / "privacy_ledger.jsonl").is_file()  # the non-DP algorithms charge nothing
    sim_eps = _client_epsilons(LedgerFile(sim / "privacy_ledger.jsonl").read()) if private else {}
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
                                   f"round-timeout=300.0 straggler-timeout=20.0")
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
                for r in _metrics(run_dir)]
    assert uploaded == [(3, 0, 0), (2, 0, 1), (1, 1, 1)]
    record = json.loads((run_dir / DEPLOYMENT_RECORD).read_text())["clients"]
    assert record["1"]["dropped"] is True
    assert record["1"]["epsilon_server_view"] == pytest.approx(own.epsilon(), rel=1e-12)
    model = _global_model(run_dir)
    assert all(bool(torch.isfinite(v).all()) for v in model.values())
    assert not math.isnan(json.loads((run_dir / "summary.json").read_text())["final"]["accuracy"])


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
