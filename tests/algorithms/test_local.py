"""Local-only training (LocalOnly, without and with privacy) and the majority-label baseline (issue 23)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from callbacks import RDPAccounting
from fedfdp.algorithms import FedAvg, LocalOnly
from fedfdp.errors import ConfigError
from fedfdp.experiments.baselines import majority_label_accuracy, majority_label_baseline
from fedfdp.privacy import SampleLevelDP
from fedfdp.types import RoundContext
from tests.helpers import fit_resumable, flat, run_federation, tiny_client, tiny_data

MECHANISM = dict(sample_rate=0.2, max_grad_norm=0.5, noise_multiplier=1.0)
NONDP = dict(lr=0.1, batch_size=32)


def private(lr: float = 1.0, **mechanism) -> dict:
    """The options of a private run (the retired DP twins'): ``lr`` and the record-level mechanism."""
    return dict(lr=lr, privacy=SampleLevelDP(**{**MECHANISM, **mechanism}))


CASES = [(lambda: LocalOnly(**NONDP), lambda: FedAvg(**NONDP), list),
         (lambda: LocalOnly(**private()), lambda: FedAvg(**private()), lambda: [RDPAccounting()])]
IDS = ["local", "dp-local"]


def _client_at(params):
    client = tiny_client()
    client.set_flat_params(params)
    return client


@pytest.mark.parametrize("make, parent, callbacks", CASES, ids=IDS)
def test_each_client_trains_and_is_evaluated_on_its_own_model(make, parent, callbacks):
    """v_i is the parent's local loop chained from w_0 on client i's data only; evaluation uses v_i.
    The reference is computed client by client, so the federation trains client by client too: a
    stacked round equals it only up to float rounding, in bits that depend on the CPU's kernels."""
    rounds, data = 3, tiny_data(num_clients=4)
    fed, _ = run_federation(make(), callbacks(), rounds=rounds, data=data, stacked_round=False)
    alg, ref, w0 = fed.algorithm, parent(), tiny_client().get_flat_params()
    own = {}
    for cid in range(fed.num_clients):
        v = w0
        for r in range(rounds):
            gen = fed.generator("client", r, cid)
            v = ref.local_update(_client_at(v), fed.client_data(cid), RoundContext(r), gen).params
        assert torch.equal(alg.client_state.get(cid, "local"), v)
        own[cid] = v
    assert all(not torch.equal(own[a], own[b]) for a in own for b in own if a < b)
    groups = alg.evaluation_groups(flat(fed.global_model), fed.num_clients)
    assert sorted(c for ids, _ in groups for c in ids) == list(range(fed.num_clients))
    for ids, params in groups:
        assert len(ids) == 1 and torch.equal(params, own[ids[0]])
    for cid in range(fed.num_clients):  # the reported per-client accuracy is that of the client's own model
        x, y = data.client_test(cid)
        net = _client_at(own[cid]).net.eval()
        with torch.no_grad():
            accuracy = (net(x).argmax(1) == y).double().mean()
        assert float(fed.last_evaluation.client_accuracy[cid]) == pytest.approx(float(accuracy), abs=1e-9)


@pytest.mark.parametrize("optimizer", [lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.9),
                                       lambda p: torch.optim.Adam(p, lr=0.1)], ids=["sgd-momentum", "adam"])
@pytest.mark.parametrize("make, parent, callbacks", CASES, ids=IDS)
def test_nothing_is_aggregated_the_global_model_stays_w0(make, parent, callbacks, optimizer):
    fed, _ = run_federation(make(), callbacks(), rounds=3, server_optimizer=optimizer)
    assert torch.equal(flat(fed.global_model), tiny_client().get_flat_params())
    assert fed.algorithm.client_state.clients() == list(range(fed.num_clients))


def test_a_client_not_yet_sampled_is_evaluated_on_w0():
    fed, _ = run_federation(LocalOnly(**NONDP), [], rounds=1, clients_per_round=1, data=tiny_data(num_clients=4))
    alg, w0 = fed.algorithm, tiny_client().get_flat_params()
    trained = alg.client_state.clients()
    assert len(trained) == 1
    groups = alg.evaluation_groups(flat(fed.global_model), fed.num_clients)
    rest = [ids for ids, params in groups if torch.equal(params, w0)]
    assert rest == [[c for c in range(4) if c not in trained]]


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(ema_decay=0.9), "model.ema_decay must be null for LocalOnly"),
    (dict(server_optimizer=lambda p: torch.optim.SGD(p, lr=1.0, weight_decay=0.1)), "model.server_optimizer"),
], ids=["ema", "weight-decay"])
def test_a_moving_or_averaged_global_model_is_refused(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        run_federation(LocalOnly(**private()), [RDPAccounting()], rounds=1, **kwargs)


def test_dp_local_only_epsilon_and_rounds_are_dp_fedavgs():
    """Same events per round, so the same ε after the same rounds and the same rounds in a budget."""
    assert LocalOnly(**private()).planned_dp_events(0, 100) == FedAvg(**private()).planned_dp_events(0, 100)
    local, ref = RDPAccounting(), RDPAccounting()
    run_federation(LocalOnly(**private()), [local], rounds=3)
    run_federation(FedAvg(**private()), [ref], rounds=3)
    assert local.epsilon() == pytest.approx(ref.epsilon(), rel=1e-12) and 0 < local.epsilon() < float("inf")
    budget = dict(target_epsilon=1.0, delta=1e-5)
    a, _ = run_federation(LocalOnly(**private(noise_multiplier=3.0)), [RDPAccounting(**budget)], rounds=None)
    b, _ = run_federation(FedAvg(**private(noise_multiplier=3.0)), [RDPAccounting(**budget)], rounds=None)
    assert a.total_rounds == b.total_rounds >= 1


def test_privacy_flags():
    assert LocalOnly(**private()).evaluated_models_covered is True
    assert not LocalOnly.supports_distributed and not LocalOnly(**private()).supports_distributed
    # the private steps from each client's own model, one or several: stacked through the grouped
    # network (tests/engine/test_stacked.py); the plain loop runs per client
    assert LocalOnly(**private()).stackable_step(RoundContext(0)) is not None
    assert LocalOnly(**private(local_steps=2)).stackable_step(RoundContext(0)) is not None
    assert LocalOnly(lr=0.1).stackable_step(RoundContext(0)) is None


def test_resume_restores_the_clients_models_bitwise(tmp_path):
    """2 rounds, checkpoint, resume to 4 ≡ 4 rounds straight."""
    straight = fit_resumable(lambda: LocalOnly(**private()), 4)
    fit_resumable(lambda: LocalOnly(**private()), 2, tmp_path)
    resumed = fit_resumable(lambda: LocalOnly(**private()), 4, tmp_path, str(tmp_path / "last.ckpt"))
    a, b = straight.algorithm.client_state, resumed.algorithm.client_state
    assert a.clients() == b.clients() and a.clients()
    for cid in a.clients():
        assert torch.equal(a.get(cid, "local"), b.get(cid, "local"))


def test_local_only_deploys_with_its_models_kept_on_the_nodes():
    """Each client's own model is client state (it never leaves the node in a deployment)."""
    pytest.importorskip("flwr", reason="the flower extra is not installed")
    from fedfdp.flower.strategy import check_deployable

    for make in (LocalOnly, lambda: LocalOnly(lr=1.0, privacy=SampleLevelDP())):
        algorithm = make()
        check_deployable(algorithm, [])
        algorithm.client_state.set(1, "local", torch.ones(3))
        exported = algorithm.export_client_state(1)
        assert list(exported) == ["client_state/local"] and algorithm.export_client_state(0) == {}
        fresh = make()
        fresh.import_client_state(1, exported)
        assert torch.equal(fresh.client_state.get(1, "local"), torch.ones(3))
        assert fresh.public_server_state() == {}


# ---- majority-label baseline --------------------------------------------------------------------
def test_majority_label_accuracy_on_a_hand_made_split():
    """Client 0 trains on labels 1 1 2 (majority 1), client 1 on 0 3 3 3 (majority 3), client 2 on
    2 0 (tie: the smaller label, 0)."""
    train_y, train_c = [1, 1, 2, 0, 3, 3, 3, 2, 0], [0, 0, 0, 1, 1, 1, 1, 2, 2]
    test_y = [1, 2, 1, 1, 3, 0, 0, 3, 0, 2, 2, 2]
    test_c = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]  # client 0: 3/4, client 1: 2/4, client 2: 1/4
    b = majority_label_accuracy(np.array(train_y), np.array(train_c), np.array(test_y), np.array(test_c),
                                num_clients=3, num_classes=4)
    assert b["majority_labels"] == [1, 3, 0]
    assert b["client_accuracy"] == [0.75, 0.5, 0.25]
    assert b["pooled"] == pytest.approx(6 / 12) and b["worst"] == pytest.approx(0.25)
    assert b["worst10"] == pytest.approx(0.25)


def test_majority_label_baseline_reads_the_datamodules_split():
    dm = tiny_data(num_clients=4, val_fraction=0.2)
    dm.setup("fit")
    b = majority_label_baseline(dm)
    correct = total = 0
    for cid in range(4):
        label = int(torch.bincount(dm.client_train(cid)[1], minlength=dm.num_classes).argmax())
        y = dm.client_test(cid)[1]
        assert b["majority_labels"][cid] == label
        assert b["client_accuracy"][cid] == pytest.approx(float((y == label).double().mean()))
        correct, total = correct + int((y == label).sum()), total + y.numel()
    assert b["pooled"] == pytest.approx(correct / total)
    assert majority_label_baseline(dm, "val")["majority_labels"] == b["majority_labels"]


@pytest.mark.slow
def test_majority_label_of_a_features_config_is_that_of_its_split(tmp_path):
    """A config with a feature front end (ScatterNet) gives the majority baseline of its split: the
    features are left out (labels only), so the scatter rows' table needs no feature extraction."""
    import yaml

    from fedfdp.experiments.baselines import datamodule_from_config
    from tests.conftest import REPO

    scatter = REPO / "configs" / "fmnist_local_dp_scatter.yaml"
    plain = yaml.safe_load(scatter.read_text())
    del plain["data"]["init_args"]["features"]
    (tmp_path / "plain.yaml").write_text(yaml.safe_dump(plain))
    with_features = majority_label_baseline(datamodule_from_config(scatter, labels_only=True))
    assert with_features == majority_label_baseline(datamodule_from_config(tmp_path / "plain.yaml"))
