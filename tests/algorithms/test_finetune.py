"""DP-FedAvg then private per-client fine-tuning (DPFedAvgFineTune, issue 23 item 7)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils import parameters_to_vector

from callbacks import RDPAccounting
from fedfdp.algorithms import DPFedAvgFineTune, FedAvg, LocalOnly
from fedfdp.algorithms.finetune import switch_round
from fedfdp.errors import ConfigError
from fedfdp.privacy import SampleLevelDP
from fedfdp.types import RoundContext
from tests.helpers import fit_resumable, flat, run_federation, tiny_client, tiny_data

MECHANISM = dict(sample_rate=0.2, max_grad_norm=0.5, noise_multiplier=1.0)


def private(lr: float = 1.0, **mechanism) -> dict:
    """The options of a private run (the retired DP twins'): ``lr`` and the record-level mechanism."""
    return dict(lr=lr, privacy=SampleLevelDP(**{**MECHANISM, **mechanism}))


def _client_at(params):
    client = tiny_client()
    client.set_flat_params(params)
    return client


def test_switch_round():
    assert [switch_round(10, f) for f in (0.0, 0.05, 0.2, 0.5, 0.99, 1.0)] == [10, 9, 8, 5, 0, 0]


def test_fraction_zero_is_dp_fedavg():
    data = tiny_data(num_clients=3)
    # both train client by client: a stacked round equals that only up to float rounding, in bits
    # that depend on the CPU's kernels (equal on AVX2, not on AVX-512)
    fed, _ = run_federation(DPFedAvgFineTune(finetune_fraction=0.0, **private()), [RDPAccounting()], rounds=3,
                            data=data, stacked_round=False)
    ref, _ = run_federation(FedAvg(**private()), [RDPAccounting()], rounds=3, data=tiny_data(num_clients=3),
                            stacked_round=False)
    assert torch.equal(flat(fed.global_model), flat(ref.global_model))
    assert fed.algorithm.finetune_start is None and fed.algorithm.client_state.clients() == []
    assert torch.equal(fed.last_evaluation.client_accuracy, ref.last_evaluation.client_accuracy)


def test_fraction_one_is_local_only_dp_from_w0():
    fed, _ = run_federation(DPFedAvgFineTune(finetune_fraction=1.0, finetune_lr=0.7, **private()), [RDPAccounting()],
                            rounds=3, data=tiny_data(num_clients=3))
    ref, _ = run_federation(LocalOnly(**private(lr=0.7)), [RDPAccounting()], rounds=3,
                            data=tiny_data(num_clients=3))
    assert torch.equal(fed.algorithm.finetune_start, tiny_client().get_flat_params())
    for cid in range(3):
        assert torch.equal(fed.algorithm.client_state.get(cid, "finetuned"),
                           ref.algorithm.client_state.get(cid, "local"))
    assert torch.equal(fed.last_evaluation.client_accuracy, ref.last_evaluation.client_accuracy)


@pytest.mark.parametrize("ema_decay", [None, 0.5], ids=["no-ema", "ema"])
def test_dp_fedavg_then_each_client_fine_tunes_the_released_model(ema_decay):
    """4 rounds at f = 0.5: rounds 0-1 are DP-FedAvg's; w̄ is the model it releases after them (its EMA
    when set); v_i is then client i's chain of DP-SGD steps at finetune_lr from w̄; evaluation uses v_i."""
    rounds, lr_ft = 4, 0.3
    fed, _ = run_federation(DPFedAvgFineTune(finetune_fraction=0.5, finetune_lr=lr_ft, **private()), [RDPAccounting()],
                            rounds=rounds, data=tiny_data(num_clients=3), ema_decay=ema_decay,
                            stacked_round=False)  # as its references: client by client (see above)
    alg = fed.algorithm
    assert alg.switch_round == 2
    ref, _ = run_federation(FedAvg(**private()), [RDPAccounting()], rounds=2, data=tiny_data(num_clients=3),
                            ema_decay=ema_decay, stacked_round=False)
    released = parameters_to_vector(ref.released_model.parameters()).detach()
    assert torch.equal(alg.finetune_start, released)
    if ema_decay is not None:
        assert not torch.equal(released, flat(ref.global_model))
    step = FedAvg(**private(lr=lr_ft))
    context = RoundContext(0)
    for cid in range(3):
        v = released
        for r in range(2, rounds):
            v = step.local_update(_client_at(v), fed.client_data(cid), context, fed.generator("client", r, cid)).params
        assert torch.equal(alg.client_state.get(cid, "finetuned"), v)
    groups = alg.evaluation_groups(flat(fed.global_model), 3)
    assert sorted(ids[0] for ids, _ in groups) == [0, 1, 2]
    for ids, params in groups:
        assert len(ids) == 1 and torch.equal(params, alg.client_state.get(ids[0], "finetuned"))


def test_epsilon_and_budgeted_rounds_are_dp_fedavgs():
    """Every round makes DP-FedAvg's events, in both phases."""
    mine, ref = RDPAccounting(), RDPAccounting()
    run_federation(DPFedAvgFineTune(finetune_fraction=0.5, **private()), [mine], rounds=4)
    run_federation(FedAvg(**private()), [ref], rounds=4)
    assert mine.epsilon() == pytest.approx(ref.epsilon(), rel=1e-12) and 0 < mine.epsilon() < float("inf")
    budget = dict(target_epsilon=1.0, delta=1e-5)
    a, _ = run_federation(DPFedAvgFineTune(finetune_fraction=0.5, **private(noise_multiplier=3.0)),
                          [RDPAccounting(**budget)], rounds=None)
    b, _ = run_federation(FedAvg(**private(noise_multiplier=3.0)), [RDPAccounting(**budget)], rounds=None)
    assert a.total_rounds == b.total_rounds >= 2
    assert a.algorithm.switch_round == switch_round(a.total_rounds, 0.5)
    assert DPFedAvgFineTune.evaluated_models_covered is True and not DPFedAvgFineTune.supports_distributed


@pytest.mark.parametrize("fraction", [1.0, 0.75])
def test_resume_restores_the_switch_the_start_and_the_clients_models(tmp_path, fraction):
    """2 rounds, checkpoint, resume to 4: the switch fixed in the first run is kept (t_s of 2 planned
    rounds), and the resumed run continues the fine-tuning bit for bit."""
    make = lambda: DPFedAvgFineTune(finetune_fraction=fraction, **private())  # noqa: E731
    first = fit_resumable(make, 2, tmp_path)
    resumed = fit_resumable(make, 4, tmp_path, str(tmp_path / "last.ckpt"))
    assert resumed.algorithm.switch_round == first.algorithm.switch_round == switch_round(2, fraction)
    assert torch.equal(resumed.algorithm.finetune_start, first.algorithm.finetune_start)
    if fraction == 1.0:  # the same plan either way: the resumed run equals a straight one
        straight = fit_resumable(make, 4)
        for cid in straight.algorithm.client_state.clients():
            assert torch.equal(straight.algorithm.client_state.get(cid, "finetuned"),
                               resumed.algorithm.client_state.get(cid, "finetuned"))


@pytest.mark.parametrize("kwargs, message", [
    (dict(finetune_fraction=1.5), "algorithm.finetune_fraction must be in [0, 1], got 1.5"),
    (dict(finetune_fraction=float("nan")), "algorithm.finetune_fraction must be in [0, 1]"),
    (dict(finetune_lr=0.0), "algorithm.finetune_lr must be null or finite and > 0, got 0.0"),
])
def test_bad_settings_are_one_line(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        DPFedAvgFineTune(**kwargs, privacy=SampleLevelDP())


def test_deploys_with_its_models_on_the_nodes_and_the_start_sent_by_the_server():
    pytest.importorskip("flwr", reason="the flower extra is not installed")
    from fedfdp.flower.strategy import check_deployable

    alg = DPFedAvgFineTune(**private())
    check_deployable(alg, [])
    assert alg.public_server_state() == {"finetune_start": None}
    alg.client_state.set(1, "finetuned", torch.ones(3))
    assert list(alg.export_client_state(1)) == ["client_state/finetuned"] and alg.export_client_state(0) == {}
    node = DPFedAvgFineTune(**private())
    node.load_public_server_state({"finetune_start": torch.zeros(3)})
    node.import_client_state(1, alg.export_client_state(1))
    assert torch.equal(node.client_start_params(1, torch.full((3,), 5.0), RoundContext(3, {"finetune": 1.0})),
                       torch.ones(3))
    assert torch.equal(node.client_start_params(0, torch.full((3,), 5.0), RoundContext(3, {"finetune": 1.0})),
                       torch.zeros(3))
    assert torch.equal(node.client_start_params(0, torch.full((3,), 5.0), RoundContext(1, {"finetune": 0.0})),
                       torch.full((3,), 5.0))
