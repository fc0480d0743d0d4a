"""Loss-weighted aggregation (FedFDPFairAgg): FedFDP at zero strength, monotone weights, no extra ε."""

from __future__ import annotations

import math

import pytest
import torch

from callbacks import FederationCallback, NoisyLossReporting, RDPAccounting
from fedfdp.algorithms import DPFedAvgFairAgg, FedAvg, FedFDP, FedFDPFairAgg
from fedfdp.algorithms.fairagg import fair_aggregation_weights
from fedfdp.errors import ConfigError
from fedfdp.interfaces import is_instance_of
from fedfdp.privacy import SampleLevelDP
from fedfdp.types import ClientUpdate, RoundContext
from tests.helpers import flat, run_federation

MECHANISM = dict(sample_rate=0.2, max_grad_norm=1.0, noise_multiplier=1.0)


def private() -> dict:
    """The options of every private algorithm here: ``lr`` 0.5 and the record-level mechanism."""
    return dict(lr=0.5, privacy=SampleLevelDP(**MECHANISM))


class _Events(FederationCallback):
    """Records every (client, kind, event) the server sees."""

    def __init__(self) -> None:
        self.events: list = []

    def on_before_aggregate(self, trainer, federation, updates):
        self.events += [(federation.current_round, u.client_id, kind, e) for u in updates for kind, e in u.dp_events]


def _fit(algorithm, rounds=3, loss_clip_rule="fixed"):
    accountant, events = RDPAccounting(), _Events()
    fed, _ = run_federation(algorithm, [NoisyLossReporting(loss_clip_rule=loss_clip_rule), accountant, events],
                            rounds=rounds)
    return fed, accountant, events


# ---- zero strength is FedFDP ---------------------------------------------------------------------------
@pytest.mark.parametrize("options", [dict(tilt=0.0), dict(fair_weight_rule="power", q_fair=0.0),
                                     dict(tilt=3.0, mix=1.0)], ids=["tilt0", "q0", "mix1"])
def test_zero_fairness_pressure_is_fedfdp_bit_for_bit(options):
    reference, _, _ = _fit(FedFDP(**private()))
    fair, _, _ = _fit(FedFDPFairAgg(**options, **private()))
    assert torch.equal(flat(fair.global_model), flat(reference.global_model))
    assert fair.algorithm.broadcast_loss == reference.algorithm.broadcast_loss


def test_dpfedavg_variant_at_zero_tilt_is_dpfedavg_bit_for_bit():
    reference, _ = run_federation(FedAvg(**private()), [RDPAccounting()], rounds=3)
    fair, _, _ = _fit(DPFedAvgFairAgg(tilt=0.0, **private()))
    assert torch.equal(flat(fair.global_model), flat(reference.global_model))


def test_a_positive_tilt_changes_the_model():
    reference, _, _ = _fit(FedFDP(**private()))
    fair, _, _ = _fit(FedFDPFairAgg(tilt=5.0, **private()))
    assert not torch.equal(flat(fair.global_model), flat(reference.global_model))


# ---- the weights ---------------------------------------------------------------------------------------
def _updates(losses, sizes):
    d = len(losses)
    return [ClientUpdate(client_id=i, params=torch.eye(d)[i], num_examples=n, reported_loss=f)
            for i, (f, n) in enumerate(zip(losses, sizes))]


@pytest.mark.parametrize("options", [dict(tilt=1.0), dict(tilt=2.0, mix=0.5),
                                     dict(fair_weight_rule="power", q_fair=1.0),
                                     dict(fair_weight_rule="power", q_fair=3.0, mix=0.3)],
                         ids=["exp", "exp-mix", "power", "power-mix"])
def test_weights_rise_with_the_reported_loss(options):
    """Equal sizes, increasing F̃_i: the aggregate (of one-hot models, i.e. the weights) increases."""
    algorithm = FedFDPFairAgg(**options, **private())
    losses = [-0.2, 0.1, 0.4, 0.9, 2.0]  # a noisy release can be negative
    weights = algorithm.aggregate(torch.zeros(5), _updates(losses, [100] * 5), RoundContext(round=0)).tolist()
    assert math.isclose(sum(weights), 1.0, rel_tol=1e-6)
    assert weights == sorted(weights) and len(set(weights)) == 5  # a loss ≤ 0 meets the power rule's floor
    assert weights[-1] > 0.2  # more than the size weight
    if "mix" in options:  # π_i ≥ mix · p_i
        assert min(weights) >= options["mix"] * 0.2 - 1e-7


def test_the_weights_are_the_formula_and_keep_the_size_factor():
    sizes, losses = [100, 300, 600], [1.0, 0.5, 0.2]
    got = fair_aggregation_weights(sizes, losses, rule="exp", tilt=2.0)
    raw = [n * math.exp(2.0 * f) for n, f in zip(sizes, losses)]
    assert got == pytest.approx([r / sum(raw) for r in raw])
    got = fair_aggregation_weights(sizes, losses, rule="power", q_fair=2.0, mix=0.25)
    raw = [n * f ** 2 for n, f in zip(sizes, losses)]
    assert got == pytest.approx([0.75 * r / sum(raw) + 0.25 * n / 1000 for r, n in zip(raw, sizes)])
    # exp is shift-invariant, power is scale-invariant; neither overflows
    assert fair_aggregation_weights(sizes, [f + 50 for f in losses], rule="exp", tilt=2.0) == pytest.approx(
        fair_aggregation_weights(sizes, losses, rule="exp", tilt=2.0))
    assert fair_aggregation_weights(sizes, [f * 7 for f in losses], rule="power", q_fair=2.0) == pytest.approx(
        fair_aggregation_weights(sizes, losses, rule="power", q_fair=2.0))
    extreme = fair_aggregation_weights(sizes, losses, rule="exp", tilt=1e4)
    assert all(math.isfinite(w) for w in extreme) and extreme[0] == pytest.approx(1.0)


def test_an_unset_strength_is_one_for_either_rule():
    exp, power = FedFDPFairAgg(**private()), FedFDPFairAgg(fair_weight_rule="power", **private())
    assert (exp.tilt, exp.q_fair, power.tilt, power.q_fair) == (1.0, 0.0, 0.0, 1.0)


def test_round_metrics_report_the_spread_of_the_weights():
    algorithm = FedFDPFairAgg(tilt=1.0, **private())
    metrics = algorithm.on_round_end(_updates([0.1, 1.1], [100, 100]), RoundContext(round=0))
    assert metrics["fair_weight_ratio"] == pytest.approx(math.e)
    assert metrics["fair_weight_max"] == pytest.approx(math.e / (1 + math.e))
    assert metrics["fair_weight_max_over_size"] == pytest.approx(2 * math.e / (1 + math.e))
    assert 1 < metrics["fair_weight_neff"] < 2
    assert "broadcast_loss" in metrics  # FedFDP's own metric is kept


# ---- privacy: no new release ---------------------------------------------------------------------------
@pytest.mark.parametrize("loss_clip_rule", ["fixed", "paper_adaptive"])
def test_it_charges_exactly_fedfdps_dp_events_and_epsilon(loss_clip_rule):
    ref, ref_acc, ref_events = _fit(FedFDP(**private()), loss_clip_rule=loss_clip_rule)
    fair, acc, events = _fit(FedFDPFairAgg(tilt=3.0, mix=0.2, **private()), loss_clip_rule=loss_clip_rule)
    assert events.events == ref_events.events and events.events
    assert {cid: led.events for cid, led in acc.ledgers.items()} == \
           {cid: led.events for cid, led in ref_acc.ledgers.items()}
    assert acc.epsilon() == ref_acc.epsilon() > 0
    assert fair.algorithm.dp_releases() == ref.algorithm.dp_releases()
    assert fair.algorithm.planned_dp_events(0, 100) == ref.algorithm.planned_dp_events(0, 100)
    assert fair.planned_dp_events(0) == ref.planned_dp_events(0)  # and hence the same round budget


def test_it_needs_the_noisy_loss_release():
    assert "callbacks.NoisyLossReporting" in FedFDPFairAgg.required_callbacks
    assert "callbacks.NoisyLossReporting" in DPFedAvgFairAgg.required_callbacks
    assert is_instance_of(NoisyLossReporting(), "callbacks.NoisyLossReporting")
    with pytest.raises(RuntimeError, match="reported no loss"):
        FedFDPFairAgg(**private()).aggregate(torch.zeros(1), [ClientUpdate(client_id=0, params=torch.zeros(1),
                                                                    num_examples=1)], RoundContext(round=0))


# ---- bad options ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("options", "message"), [
    (dict(fair_weight_rule="softmax"), r"algorithm\.fair_weight_rule must be one of \['exp', 'power'\], got 'softmax'"),
    (dict(tilt=-1.0), r"algorithm\.tilt must be finite and >= 0, got -1\.0"),
    (dict(tilt=math.inf), r"algorithm\.tilt must be finite and >= 0, got inf"),
    (dict(fair_weight_rule="power", q_fair=-0.5), r"algorithm\.q_fair must be finite and >= 0, got -0\.5"),
    (dict(fair_weight_rule="power", tilt=1.0), r"algorithm\.tilt applies only to fair_weight_rule 'exp'"),
    (dict(q_fair=1.0), r"algorithm\.q_fair applies only to fair_weight_rule 'power'"),
    (dict(mix=1.5), r"algorithm\.mix must be in \[0, 1\], got 1\.5"),
    (dict(mix=-0.1), r"algorithm\.mix must be in \[0, 1\], got -0\.1"),
    (dict(fair_weight_rule="power", q_fair=1.0, loss_floor=0.0), r"algorithm\.loss_floor must be finite and > 0"),
], ids=["rule", "tilt<0", "tilt-inf", "q<0", "tilt-with-power", "q-with-exp", "mix>1", "mix<0", "floor0"])
@pytest.mark.parametrize("cls", [FedFDPFairAgg, DPFedAvgFairAgg], ids=lambda c: c.__name__)
def test_bad_options_are_refused_with_one_line(cls, options, message):
    with pytest.raises(ConfigError, match=message) as err:
        cls(**options, privacy=SampleLevelDP())
    assert "\n" not in str(err.value)
