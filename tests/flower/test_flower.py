"""The Flower deployment (fedfdp.flower): the same algorithm as the simulation, each client keeping its own budget.

Fast tests (no Flower process): the client's ledger and refusal, the node settings, what cannot be
deployed, the message encoding, and the server strategy end to end over an in-process grid that
hands each message to the ClientApp in this process (every algorithm over that grid:
``tests/flower/test_flower_algorithms.py``; over real SuperLink and SuperNode processes:
``tests/flower/test_flower_deployment.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

flwr = pytest.importorskip("flwr", reason="the flower extra is not installed (pip install -e '.[flower]')")

import torch  # noqa: E402

from callbacks import NoisyLossReporting, RDPAccounting, SourceInferenceAudit  # noqa: E402
from fedfdp.algorithms import Ditto, DPFedAvgPriorCorrection, FedAvg, FedFDP, FedFDPFairAgg, Scaffold  # noqa: E402
from fedfdp.errors import ConfigError  # noqa: E402
from fedfdp.flower import protocol  # noqa: E402
from fedfdp.flower.node import NodeClient, NodeSettings  # noqa: E402
from fedfdp.flower.node_ledger import NodeLedger, ledger_path  # noqa: E402
from fedfdp.flower.server_app import DEPLOYMENT_RECORD, ServerSettings, run_server  # noqa: E402
from fedfdp.flower.strategy import check_deployable  # noqa: E402
from fedfdp.privacy import SampleLevelDP  # noqa: E402
from fedfdp.privacy.accounting import DPEvent, epsilon_of  # noqa: E402
from fedfdp.privacy.ledger_file import LedgerFile  # noqa: E402
from fedfdp.seeding import SecureGenerator  # noqa: E402
from fedfdp.types import ClientUpdate  # noqa: E402
from tests.flower_harness import CONFIGS, OVERRIDES, ROUNDS, TIGHT_TARGET, InProcessGrid, client_epsilons, \
    global_model, grid_nodes, max_relative_difference, simulate, upload_rows  # noqa: E402

MODEL = DPEvent(noise_multiplier=1.0, sample_rate=0.2)   # tiny configs: one DP-SGD step per round
LOSS = DPEvent(noise_multiplier=5.0, sample_rate=0.2)    # and FedFDP's loss release


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
    (FedFDP(privacy=SampleLevelDP()), [NoisyLossReporting(), RDPAccounting(), SourceInferenceAudit()],
     "SourceInferenceAudit reads every"),
])
def test_what_cannot_run_on_nodes_is_refused_with_one_line(algorithm, callbacks, message):
    with pytest.raises(ConfigError, match=message) as err:
        check_deployable(algorithm, callbacks)
    assert "\n" not in str(err.value)


def test_deployable_algorithms():
    # all: test_flower_algorithms; DP-FedAvg and DP-Ditto are FedAvg and Ditto with privacy (lr 1.0, the twins' default)
    for algorithm in (FedAvg(lr=1.0, privacy=SampleLevelDP()), FedFDP(privacy=SampleLevelDP()),
                      FedFDPFairAgg(privacy=SampleLevelDP()), Scaffold(), Ditto(lr=1.0, privacy=SampleLevelDP()),
                      DPFedAvgPriorCorrection(privacy=SampleLevelDP())):
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
@pytest.mark.slow
def test_strategy_over_in_process_nodes_equals_simulation(tmp_path):
    """The server strategy and the ClientApp, without processes: the simulation's model and ε, bit for bit."""
    sim = simulate("fedfdp", tmp_path / "sim")
    grid = InProcessGrid(grid_nodes(tmp_path / "ledgers"))
    settings = ServerSettings.from_run_config({"config": str(CONFIGS["fedfdp"]), "overrides": OVERRIDES,
                                               "run-dir": str(tmp_path / "flower")})
    run_dir = run_server(grid, settings)  # type: ignore[arg-type]
    assert max_relative_difference(global_model(sim), global_model(run_dir)) == 0.0
    nodes = [e for c in range(3) for e in LedgerFile(ledger_path(tmp_path / "ledgers", c)).read()]
    assert client_epsilons(nodes) == client_epsilons(LedgerFile(sim / "privacy_ledger.jsonl").read())
    for name in ("config.yaml", "metrics.csv", "summary.json", "report.md", DEPLOYMENT_RECORD):
        assert (run_dir / name).is_file(), name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final"]["accuracy"] == json.loads((sim / "summary.json").read_text())["final"]["accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fedfdp", "dpditto"])
def test_a_resumed_deployment_continues_the_run(tmp_path, name):
    """ckpt-path='last' continues a deployed run to the end an uninterrupted one reaches, appending its files
    (DP-Ditto: each node continues its client's personal model from the state the checkpoint names)."""
    ledgers = tmp_path / "ledgers"

    def deploy(run_dir: Path, rounds: int, node_ledgers: Path, **extra: str) -> Path:
        overrides = OVERRIDES.replace(f"--model.num_rounds {ROUNDS}", f"--model.num_rounds {rounds}")
        settings = ServerSettings.from_run_config({"config": str(CONFIGS[name]), "run-dir": str(run_dir),
                                                   "overrides": overrides + " --checkpoint_every 1", **extra})
        return run_server(InProcessGrid(grid_nodes(node_ledgers)), settings)  # type: ignore[arg-type]

    whole = deploy(tmp_path / "whole", 4, tmp_path / "whole_ledgers")
    run_dir = deploy(tmp_path / "run", 2, ledgers)
    assert deploy(run_dir, 4, ledgers, **{"ckpt-path": "last"}) == run_dir
    assert max_relative_difference(global_model(whole), global_model(run_dir)) == 0.0
    assert [int(r["round"]) for r in upload_rows(run_dir)] == [1, 2, 3, 4]  # appended, not restarted
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


@pytest.mark.slow
def test_strategy_goes_on_without_refusing_and_silent_clients(tmp_path):
    """Client 2 refuses round 3 (its own target); client 1 never answers from round 2: the others carry on."""
    ledgers = tmp_path / "ledgers"
    grid = InProcessGrid(grid_nodes(ledgers, targets={2: TIGHT_TARGET}), silent={101}, silent_from=1)
    settings = ServerSettings.from_run_config({"config": str(CONFIGS["fedfdp"]), "overrides": OVERRIDES,
                                               "run-dir": str(tmp_path / "flower"), "round-timeout": 1.0})
    run_dir = run_server(grid, settings)  # type: ignore[arg-type]
    rounds = {c: sorted({e.round for e in LedgerFile(ledger_path(ledgers, c)).read()}) for c in range(3)}
    assert rounds == {0: [0, 1, 2], 1: [0], 2: [0, 1]}
    uploaded = [(float(r["clients_uploaded"]), float(r["clients_refused"]), float(r["clients_missing"]))
                for r in upload_rows(run_dir)]
    assert uploaded == [(3, 0, 0), (2, 0, 1), (1, 1, 1)]
    record = json.loads((run_dir / DEPLOYMENT_RECORD).read_text())["clients"]
    assert record["2"]["refused_rounds"] == [3] and record["1"]["dropped"] is True
    assert record["1"]["missed_rounds"] == [2, 3] and record["2"]["missed_rounds"] == []
    summary = json.loads((run_dir / "summary.json").read_text())  # the run says who was left out
    assert summary["status"] == "completed_with_missing_clients"
    assert summary["missing_clients"] == {"1": [2, 3], "2": [3]} and summary["refused_clients"] == {"2": [3]}
    assert summary["evaluated_clients"] == [0, 2]  # client 1's node never answered the evaluation
    report = (run_dir / "report.md").read_text().splitlines()[:10]
    assert any("client 1 left out of rounds 2-3" in line for line in report), report
    assert any("cover clients 0, 2 (2 of 3); client 1 did not answer" in line for line in report), report
    for cid in range(3):  # the server counted exactly what each client charged itself
        own = NodeLedger(ledgers, cid, target_epsilon=None).epsilon()
        assert record[str(cid)]["epsilon_server_view"] == pytest.approx(own, rel=1e-12)
    assert NodeLedger(ledgers, 2, target_epsilon=None).epsilon() <= TIGHT_TARGET


@pytest.mark.slow
def test_a_lost_node_is_named_by_its_id_and_round_and_a_slow_one_as_slow(tmp_path, caplog):
    """Client 1's node dies in round 2 (the SuperLink reports it unavailable); client 2's stays connected but silent."""
    grid = InProcessGrid(grid_nodes(tmp_path / "ledgers"), silent={102}, lost={101}, silent_from=1)
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


@pytest.mark.slow
def test_a_node_that_cannot_take_part_stops_the_run_with_its_reason(tmp_path):
    nodes = grid_nodes(tmp_path / "ledgers")
    nodes[102]["num-partitions"] = 4
    settings = ServerSettings.from_run_config({"config": str(CONFIGS["fedfdp"]), "overrides": OVERRIDES,
                                               "run-dir": str(tmp_path / "flower")})
    with pytest.raises(ConfigError, match=r"cannot take part: .*num-partitions=4 but the run's data.num_clients=3"):
        run_server(InProcessGrid(nodes), settings)  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_restarted_node_takes_its_client_back_at_the_next_round(tmp_path, caplog):
    """DP-SCAFFOLD: client 1's node is lost in round 2 and comes back under a new node id with the same
    partition, state file and ledger: it trains again from round 3 on, from its state after round 1."""
    ledgers = tmp_path / "ledgers"
    grid = InProcessGrid(grid_nodes(ledgers), lost={101}, silent_from=1, restarts={101: 111})
    overrides = OVERRIDES.replace(f"--model.num_rounds {ROUNDS}", "--model.num_rounds 4")
    settings = ServerSettings.from_run_config({"config": str(CONFIGS["dpscaffold"]), "overrides": overrides,
                                               "run-dir": str(tmp_path / "flower"), "round-timeout": 5.0})
    with caplog.at_level("WARNING"):
        run_dir = run_server(grid, settings)  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records]
    assert [m for m in lines if m.startswith("client 1: SuperNode 111 now serves partition-id=1 (SuperNode 101 "
                                             "stopped answering in round 2)")], lines
    assert "client 1 was left out of round 2 of 4" in lines
    assert sorted({e.round for e in LedgerFile(ledger_path(ledgers, 1)).read()}) == [0, 2, 3]
    assert [float(r["clients_uploaded"]) for r in upload_rows(run_dir)] == [3, 2, 3, 3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed_with_missing_clients" and summary["missing_clients"] == {"1": [2]}
    assert summary["evaluated_clients"] == [0, 1, 2] and summary["refused_clients"] == {}
    record = json.loads((run_dir / DEPLOYMENT_RECORD).read_text())["clients"]["1"]
    assert record["node_ids"] == [101, 111] and record["missed_rounds"] == [2] and record["dropped"] is False
    own = NodeLedger(ledgers, 1, target_epsilon=None).epsilon()
    assert record["epsilon_server_view"] == pytest.approx(own, rel=1e-12)


def _info(partition: int, train: int = 10) -> protocol.NodeDescription:
    return protocol.NodeDescription(partition=partition, num_partitions=2, train_size=train, test_size=5, val_size=0,
                                    target_epsilon=None, secure_rng=True, epsilon=0.0)


def test_the_roster_keeps_a_serving_node_and_takes_a_restarted_one_deterministically(caplog):
    from fedfdp.flower.roster import NodeRoster

    roster = NodeRoster({0: 10, 1: 11}, {0: _info(0), 1: _info(1)})
    answers = {20: _info(1), 21: _info(1, train=99), 22: "node-config num-partitions=4 ..."}
    asked: list[list[int]] = []

    def describe(new):
        asked.append(new)
        return {n: answers[n] for n in new if n in answers}

    with caplog.at_level("WARNING", logger="fedfdp.flower.strategy"):
        roster.refresh({10, 11, 20, 21, 22}, describe, "round 2")  # two live nodes for partition 1: 11 keeps it
        assert roster.live(1) == 11 and asked == [[20, 21, 22]]
        roster.fail(11, "round 2")
        roster.refresh({10, 11, 20, 21, 22}, describe, "round 3")  # 11 failed: 20 takes over, 21 (other data) never
        assert roster.live(1) == 20 and roster.served_by[1] == [11, 20] and asked == [[20, 21, 22]]
        roster.fail(20, "round 3")
        roster.refresh({10, 11, 20}, describe, "round 4")
        assert roster.live(1) is None and roster.without_node() == [1]
        roster.refresh({10}, describe, "round 5")  # 11 and 20 left the list: forgotten, asked again if they return
        roster.refresh({10, 20}, describe, "round 6")
        assert roster.live(1) == 20 and asked[-1] == [20]
    lines = [r.getMessage() for r in caplog.records]
    assert "SuperNodes 11 and 20 both hold partition-id=1: 11 serves it while it answers; 20 is used only if 11 is " \
           "lost" in lines
    assert any("SuperNode 21 connected for partition-id=1 but is not used" in m and "not the same data" in m
               for m in lines)
    assert any(m.startswith("SuperNode 22 connected during the run but cannot take part") for m in lines)
