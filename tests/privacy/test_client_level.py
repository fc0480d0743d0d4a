"""Client-level DP (``privacy=ClientLevelDP(...)``): each client hidden whole.

Invariants, not examples: a clipped update is within C for any input; the release is the noisy sum
over the expected cohort with noise std zC; the cohort is Poisson over the whole population; every
round (an empty one included) is charged once to the population's ledger, and ε agrees with Google's
dp-accounting (RDP and PLD) and with the TFF tutorial's published figure; the server half never sees
an upload; every algorithm whose uploads or server half hold more than the model is refused in one
line, as is an upload field outside the mechanism, δ ≥ 1/N, and a federation-drawn cohort.
"""

from __future__ import annotations

import inspect
import json
import math

import dp_accounting
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from callbacks import RDPAccounting, RunSummary
from fedfdp import algorithms
from fedfdp.algorithms import FedAvg, FedProx
from fedfdp.errors import ConfigError, PrivacyBudgetError, PrivacyError
from fedfdp.privacy import ClientLevelDP, SampleLevelDP
from fedfdp.privacy.accounting import PAPER_ORDERS, DPEvent, epsilon_of
from fedfdp.privacy.client_level import clip_to_norm
from fedfdp.privacy.planning import max_rounds
from fedfdp.privacy.run_accountant import RunAccountant
from fedfdp.seeding import make_generator
from fedfdp.types import CLIENT_RELEASE, POPULATION, ClientUpdate
from tests.helpers import flat, run_federation, tiny_client, tiny_data

DELTA = 1e-5


def population(num_clients: int = 120, num_samples: int = 1200, **kwargs):
    """A synthetic population of small clients (log-normal sizes, label skew)."""
    return tiny_data(num_clients=num_clients, num_samples=num_samples, partition="population", min_size=4, **kwargs)


def client_dp(cohort: float = 12, clip: float = 0.5, z: float = 1.0, **options) -> FedAvg:
    return FedAvg(lr=0.1, batch_size=8, privacy=ClientLevelDP(clients_per_round=cohort, clip_norm=clip,
                                                              noise_multiplier=z), **options)


def google_rdp(q: float, z: float, rounds: int, delta: float = DELTA) -> float:
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)
    return acc.get_epsilon(delta)


def google_pld(q: float, z: float, rounds: int, delta: float = DELTA) -> float:
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)
    return acc.get_epsilon(delta)


# ---- the mechanism's maths ----------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e30, 1e30, allow_nan=False, allow_subnormal=True), min_size=1, max_size=64),
       st.floats(1e-6, 1e6))
def test_a_clipped_update_is_within_c_for_any_input(values, bound):
    delta = torch.tensor(values, dtype=torch.float32)
    clipped = clip_to_norm(delta, bound)
    norm = float(torch.linalg.vector_norm(clipped.double()))
    assert norm <= bound * (1 + 1e-6)
    if float(torch.linalg.vector_norm(delta.double())) <= bound:
        assert torch.equal(clipped, delta)  # inside the ball: untouched
    else:
        assert float((clipped.double() * delta.double()).sum()) >= 0  # same direction


def test_the_release_is_the_clipped_sum_over_the_expected_cohort():
    w = torch.zeros(4)
    updates = [ClientUpdate(client_id=0, params=torch.tensor([3.0, 4.0, 0.0, 0.0]), num_examples=5),  # norm 5 -> 1
               ClientUpdate(client_id=1, params=torch.tensor([0.0, 0.0, 0.5, 0.0]), num_examples=500)]  # kept
    mechanism = ClientLevelDP(clients_per_round=2, clip_norm=1.0, noise_multiplier=0.0)
    out = mechanism.release_aggregate(w, updates, 10, make_generator(0, "aggregate", 0))
    # unweighted: sizes 5 and 500 count alike; divided by qN = 2 whatever the cohort's size
    assert torch.allclose(out, torch.tensor([0.6, 0.8, 0.5, 0.0]) / 2)


def test_the_noise_std_is_z_c_over_the_expected_cohort():
    mechanism = ClientLevelDP(clients_per_round=10, clip_norm=0.4, noise_multiplier=1.5)
    w = torch.full((200_000,), 3.0)
    out = mechanism.release_aggregate(w, [], 100, make_generator(1, "aggregate", 0))
    noise = out - w
    assert abs(float(noise.mean())) < 1e-3
    assert float(noise.std()) == pytest.approx(1.5 * 0.4 / 10, rel=0.01)


def test_the_cohort_is_poisson_over_the_whole_population():
    mechanism = ClientLevelDP(clients_per_round=5, clip_norm=1.0, noise_multiplier=1.0)
    counts, sizes = np.zeros(50), []
    for t in range(2000):
        cohort = mechanism.cohort(50, make_generator(3, "cohort", t))
        assert cohort == sorted(set(cohort)) and all(0 <= c < 50 for c in cohort)
        counts[cohort] += 1
        sizes.append(len(cohort))
    assert np.allclose(counts / 2000, 0.1, atol=0.03)  # every client at rate q = 5/50
    assert min(sizes) < 3 and max(sizes) > 8  # the cohort's size varies (not a fixed-size sample)
    assert np.mean(sizes) == pytest.approx(5, rel=0.05)


def test_an_expected_cohort_larger_than_the_population_is_refused():
    with pytest.raises(ConfigError, match=r"algorithm.privacy.clients_per_round must be <= data.num_clients=10"):
        ClientLevelDP(clients_per_round=11, clip_norm=1.0, noise_multiplier=1.0).sample_rate(10)


@pytest.mark.parametrize("field,value", [("clients_per_round", 0), ("clip_norm", math.inf), ("noise_multiplier", -1.0),
                                         ("sampling", "fixed")])
def test_bad_options_are_refused_in_one_line(field, value):
    options = {"clients_per_round": 5, "clip_norm": 1.0, "noise_multiplier": 1.0, field: value}
    with pytest.raises(ConfigError, match=rf"^algorithm.privacy.{field} must be"):
        ClientLevelDP(**options)


# ---- accounting ---------------------------------------------------------------------------------
@pytest.mark.parametrize("q,z,rounds", [(120 / 3383, 1.2, 100), (100 / 3400, 1.0, 300), (0.01, 0.8, 1000),
                                        (0.2, 3.0, 50)])
def test_client_epsilon_agrees_with_google_dp_accounting(q, z, rounds):
    acc = RunAccountant(delta=DELTA)
    acc.set_population(10_000)
    for t in range(rounds):
        acc.charge_population(t, [(CLIENT_RELEASE, DPEvent(noise_multiplier=z, sample_rate=q))])
    assert acc.unit == "client" and acc.population_rounds() == rounds
    assert acc.epsilon() == pytest.approx(google_rdp(q, z, rounds), rel=0.02)
    assert acc.record_epsilon() == acc.epsilon()  # no record-level release: a client's guarantee covers its records
    prv = RunAccountant(delta=DELTA, accountant="prv")
    prv.set_population(10_000)
    prv.charge_population(0, [(CLIENT_RELEASE, DPEvent(noise_multiplier=z, sample_rate=q, steps=rounds))])
    assert prv.epsilon() == pytest.approx(google_pld(q, z, rounds), rel=0.02)


def test_the_tff_tutorials_published_epsilon():
    # TFF's DP tutorial: EMNIST over 3,383 clients, 120 a round, z 1.2, 100 rounds: epsilon about 2 at delta 1e-5
    assert epsilon_of([DPEvent(noise_multiplier=1.2, sample_rate=120 / 3383, steps=100)], DELTA,
                      PAPER_ORDERS) == pytest.approx(2.0, abs=0.05)


def test_the_population_ledger_is_rebuilt_from_the_ledger_file(tmp_path):
    path = str(tmp_path / "privacy_ledger.jsonl")
    acc = RunAccountant(delta=DELTA, ledger_path=path)
    acc.set_population(1000)
    acc.ledger.open()
    for t in range(7):
        acc.charge_population(t, [(CLIENT_RELEASE, DPEvent(noise_multiplier=1.1, sample_rate=0.03))])
    acc.ledger.close()
    lines = [json.loads(line) for line in open(path)]
    assert {(r["client"], r["unit"], r["kind"]) for r in lines} == {(POPULATION, "client", CLIENT_RELEASE)}
    again = RunAccountant(delta=DELTA, ledger_path=path)
    again.set_population(1000)
    again.ledger.open()
    assert again.epsilon() == acc.epsilon() > 0 and again.population_rounds() == 7
    assert again.ledger.epsilon() == 0.0  # no record-unit ledger holds them


def test_delta_must_be_below_one_over_the_population():
    with pytest.raises(ConfigError, match=r"RDPAccounting.delta=0.01 guarantees nothing for one client: .* N = 120"):
        run_federation(client_dp(), [RDPAccounting(delta=0.01)], data=population())


# ---- a run --------------------------------------------------------------------------------------
def test_a_run_charges_every_round_once_and_reports_the_client_unit(tmp_path):
    fed, trainer = run_federation(client_dp(), [RDPAccounting(delta=DELTA), RunSummary(dirpath=str(tmp_path),
                                                                                       report=False)],
                                  rounds=4, data=population())
    acc = fed.accountant
    q = 12 / 120
    assert acc.population_rounds() == 4 and not acc.ledger.has_record_events()
    assert acc.epsilon() == pytest.approx(google_rdp(q, 1.0, 4), rel=0.02)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["epsilon_unit"] == "client" and summary["dp_valid"]
    client = summary["privacy"]["client"]
    assert client == {"epsilon": acc.epsilon(), "delta": DELTA, "noise_multiplier": 1.0, "sampling_rate": q,
                      "rounds": 4, "population": 120, "models_covered": "every model the run evaluates and reports",
                      "models": "global"}
    assert summary["privacy"]["record"]["epsilon"] == acc.epsilon()


def test_an_empty_cohort_still_releases_noise_and_is_charged():
    # q = 0.1 / 120: most rounds sample nobody (probability 0.9); each still releases w + noise and is charged
    seen = []

    class Cohorts(RDPAccounting):
        def on_round_start(self, trainer, federation, context, client_ids):
            seen.append(list(client_ids))
            super().on_round_start(trainer, federation, context, client_ids)

    start = flat(tiny_client().net)
    fed, _ = run_federation(client_dp(cohort=0.1), [Cohorts(delta=DELTA)], rounds=6, data=population())
    assert sum(1 for c in seen if not c) >= 3
    assert fed.accountant.population_rounds() == 6
    moved = flat(fed.global_model) - start  # noise alone moved it in the empty rounds: finite, nonzero
    assert torch.isfinite(moved).all() and float(moved.abs().min()) > 0


def test_the_budget_sets_the_rounds():
    q, z, target = 12 / 120, 2.0, 1.5
    planned = max_rounds([DPEvent(noise_multiplier=z, sample_rate=q)], target_epsilon=target, delta=DELTA,
                         orders=PAPER_ORDERS, rule="strict", accountant="rdp")
    fed, trainer = run_federation(client_dp(z=z), [RDPAccounting(delta=DELTA, target_epsilon=target)], rounds=None,
                                  data=population())
    assert trainer.global_step == planned == fed.accountant.population_rounds()
    assert fed.accountant.epsilon() <= target < epsilon_of([DPEvent(noise_multiplier=z, sample_rate=q,
                                                                    steps=planned + 1)], DELTA, PAPER_ORDERS)


def test_the_guard_refuses_a_round_past_the_budget():
    acc = RunAccountant(delta=DELTA, target_epsilon=1.0)
    acc.set_population(100)
    event = [(CLIENT_RELEASE, DPEvent(noise_multiplier=0.5, sample_rate=0.5))]
    with pytest.raises(PrivacyBudgetError, match="for a client of the population"):
        acc.budget.check_round(0, [], lambda cid: [], event)


def test_the_server_half_sees_no_upload():
    calls = []

    class Watch(RDPAccounting):
        def on_round_end(self, trainer, federation, context, updates, metrics):
            calls.append(federation.algorithm)
            super().on_round_end(trainer, federation, context, updates, metrics)

    algorithm = client_dp()
    received = []
    algorithm.on_round_end = lambda updates, context: received.append(list(updates)) or {}  # type: ignore[method-assign]
    run_federation(algorithm, [Watch(delta=DELTA)], rounds=3, data=population())
    assert received == [[], [], []] and len(calls) == 3


def test_the_federation_does_not_draw_the_cohort():
    with pytest.raises(ConfigError, match=r"model.clients_per_round must be null with ClientLevelDP"):
        run_federation(client_dp(), [RDPAccounting(delta=DELTA)], data=population(), clients_per_round=10)


def test_an_upload_field_outside_the_mechanism_is_refused():
    class Leaky(FedAvg):
        accepts_client_level = True  # declared, yet its upload carries a raw statistic

        def local_update(self, client, data, context, generator):
            update = super().local_update(client, data, context, generator)
            update.extras["mean_label"] = data.y.float().mean().reshape(1)
            return update

    algorithm = Leaky(lr=0.1, privacy=ClientLevelDP(clients_per_round=12, clip_norm=0.5, noise_multiplier=1.0))
    with pytest.raises(PrivacyError, match=r"extras\['mean_label'\] \(declared by no component\)"):
        run_federation(algorithm, [RDPAccounting(delta=DELTA)], data=population())


def test_a_subclass_with_its_own_server_half_is_refused():
    class Reads(FedAvg):
        accepts_client_level = True

        def aggregate(self, global_params, updates, context):
            return updates[0].params

    with pytest.raises(ConfigError, match=r"Reads overrides aggregate, which fedfdp.privacy.ClientLevelDP never calls"):
        Reads(privacy=ClientLevelDP(clients_per_round=2, clip_norm=1.0, noise_multiplier=1.0))


def test_an_inherited_declaration_does_not_count():
    class Mine(FedAvg):
        def local_lr(self, context):
            return 0.05

    with pytest.raises(ConfigError, match=r"Mine does not run under fedfdp.privacy.ClientLevelDP"):
        Mine(privacy=ClientLevelDP(clients_per_round=2, clip_norm=1.0, noise_multiplier=1.0))


def _registry_classes():
    return {name: cls for name, cls in algorithms.load_all().items()
            if inspect.isclass(cls) and issubclass(cls, algorithms.Algorithm) and cls is not algorithms.Algorithm
            and "privacy" in inspect.signature(cls).parameters}


@pytest.mark.parametrize("name", sorted(_registry_classes()))
def test_every_algorithm_either_runs_client_level_or_refuses_in_one_line(name):
    cls = _registry_classes()[name]
    mechanism = ClientLevelDP(clients_per_round=2, clip_norm=1.0, noise_multiplier=1.0)
    if name in ("FedAvg", "FedProx"):
        algorithm = cls(privacy=mechanism)
        assert algorithm.upload_privacy() == {"params": CLIENT_RELEASE}
        assert algorithm.planned_dp_events(0, 10) == [] and algorithm.stackable_step(None) is None
        return
    with pytest.raises(ConfigError) as err:
        cls(privacy=mechanism)
    assert "\n" not in str(err.value) and "ClientLevelDP" in str(err.value)


def test_fedprox_runs_client_level():
    fed, _ = run_federation(FedProx(mu=0.1, lr=0.1, privacy=ClientLevelDP(clients_per_round=12, clip_norm=0.5,
                                                                          noise_multiplier=1.0)),
                            [RDPAccounting(delta=DELTA)], rounds=2, data=population())
    assert fed.accountant.population_rounds() == 2


def test_sample_level_and_client_level_are_different_mechanisms():
    assert SampleLevelDP.unit == "record" and not SampleLevelDP.releases_aggregate
    assert ClientLevelDP.unit == "client" and ClientLevelDP.releases_aggregate


@pytest.mark.parametrize("local_sigma", [6.0, 0.6])
def test_with_dp_sgd_inside_the_record_epsilon_is_the_better_of_two_analyses(local_sigma, tmp_path):
    local = SampleLevelDP(sample_rate=0.5, max_grad_norm=0.5, noise_multiplier=local_sigma, local_steps=2)
    algorithm = FedAvg(lr=0.5, privacy=ClientLevelDP(clients_per_round=12, clip_norm=0.5, noise_multiplier=0.8,
                                                     local=local))
    assert algorithm.upload_privacy() == {"params": "model"}  # each upload is record-level private on its own
    # the budget is the client unit's: record-level releases past it (σ 0.6: record ε ≈ 16) do not stop the run
    fed, _ = run_federation(algorithm, [RDPAccounting(delta=DELTA, target_epsilon=10.0),
                                        RunSummary(dirpath=str(tmp_path), report=False)], rounds=3, data=population())
    acc = fed.accountant
    client_eps = acc.epsilon()
    assert client_eps == pytest.approx(google_rdp(12 / 120, 0.8, 3), rel=0.02)
    trained = [cid for cid in acc.ledgers if cid != POPULATION]
    assert trained and all(acc.ledgers[cid].events for cid in trained)  # DP-SGD charged to each client's ledger
    record_eps = acc.ledger.epsilon()
    most_steps = max(sum(e.steps for e in acc.ledgers[cid].events) for cid in trained)
    assert record_eps == pytest.approx(epsilon_of([DPEvent(noise_multiplier=local_sigma, sample_rate=0.5,
                                                           steps=most_steps)], DELTA, PAPER_ORDERS))
    assert acc.record_epsilon() == min(client_eps, record_eps)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["privacy"]["record"]["epsilon"] == min(client_eps, record_eps)
    assert ("record-level releases" in summary["privacy"]["record"]["analysis"]) == (record_eps < client_eps)
    assert "in each client record-level DP-SGD" in summary["privacy_mechanism"]


# ---- adaptive clipping (Andrew et al. 2021) -----------------------------------------------------
def _updates_with_norms(norms: list[float], dim: int = 8, seed: int = 0) -> list[ClientUpdate]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k, norm in enumerate(norms):
        direction = torch.randn(dim, generator=gen)
        out.append(ClientUpdate(client_id=k, params=direction / direction.norm() * norm, num_examples=1))
    return out


@pytest.mark.parametrize("quantile", [0.2, 0.5, 0.8])
def test_adaptive_clipping_follows_the_quantile_of_the_update_norms(quantile):
    norms = list(np.linspace(0.01, 2.0, 200))
    mechanism = ClientLevelDP(clients_per_round=200, clip_norm=0.05, noise_multiplier=1.0, target_quantile=quantile,
                              clip_learning_rate=0.2, count_noise_std=1.0)
    updates = _updates_with_norms(norms)
    for t in range(400):
        mechanism.release_aggregate(torch.zeros(8), updates, 200, make_generator(0, "aggregate", t))
    assert mechanism.current_clip_norm == pytest.approx(float(np.quantile(norms, quantile)), rel=0.1)


def test_adaptive_clipping_splits_the_noise_and_is_charged_as_one_sgm():
    adaptive = ClientLevelDP(clients_per_round=10, clip_norm=0.4, noise_multiplier=1.5, target_quantile=0.5,
                             count_noise_std=2.0)
    fixed = ClientLevelDP(clients_per_round=10, clip_norm=0.4, noise_multiplier=1.5)
    assert adaptive.round_events(100) == fixed.round_events(100)  # the pair is one SGM(q, z): Theorem 1
    w = torch.zeros(200_000)
    noise = adaptive.release_aggregate(w, [], 100, make_generator(1, "aggregate", 0))
    z_delta = (1.5 ** -2 - 4.0 ** -2) ** -0.5
    assert float(noise.std()) == pytest.approx(z_delta * 0.4 / 10, rel=0.01)
    assert adaptive.current_clip_norm != 0.4  # an empty cohort's noisy count moved it
    with pytest.raises(ConfigError, match=r"count_noise_std must be > noise_multiplier / 2 = 1"):
        ClientLevelDP(clients_per_round=10, clip_norm=0.4, noise_multiplier=2.0, target_quantile=0.5,
                      count_noise_std=1.0)


def test_adaptive_clipping_resumes_its_bound():
    algorithm = client_dp()
    assert algorithm.state_dict() == {}  # a fixed C has no state: checkpoints as before
    adaptive = FedAvg(privacy=ClientLevelDP(clients_per_round=12, clip_norm=0.5, noise_multiplier=1.0,
                                            target_quantile=0.5))
    adaptive.privacy.current_clip_norm = 0.123
    restored = FedAvg(privacy=ClientLevelDP(clients_per_round=12, clip_norm=0.5, noise_multiplier=1.0,
                                            target_quantile=0.5))
    restored.load_state_dict(adaptive.state_dict())
    assert restored.privacy.current_clip_norm == 0.123


def test_an_adaptive_run_logs_its_bound_and_spends_what_a_fixed_one_does():
    logged = []

    class Log(RDPAccounting):
        def on_round_end(self, trainer, federation, context, updates, metrics):
            super().on_round_end(trainer, federation, context, updates, metrics)
            logged.append(dict(metrics))

    adaptive = FedAvg(lr=0.1, batch_size=8, privacy=ClientLevelDP(clients_per_round=12, clip_norm=0.5,
                                                                  noise_multiplier=1.0, target_quantile=0.5))
    fed, _ = run_federation(adaptive, [Log(delta=DELTA)], rounds=3, data=population())
    fixed, _ = run_federation(client_dp(), [RDPAccounting(delta=DELTA)], rounds=3, data=population())
    assert fed.accountant.epsilon() == fixed.accountant.epsilon()
    bounds = [m["client_clip_norm"] for m in logged]
    assert len(bounds) == 3 and len(set(bounds)) == 3 and bounds[-1] == fed.algorithm.privacy.current_clip_norm
