"""Baselines (FedProx, SCAFFOLD, FedDyn, q-FFL, ALI-DPFL, Ditto): degenerate equivalences, the
data-independent terms reaching the update, accounting, and the client-state store."""

from __future__ import annotations

import io

import pytest
import torch

from callbacks import GlobalLossReporting, NoisyGlobalLossReporting, NoisyLossReporting, RDPAccounting
from fedfdp.aggregate import weighted_mean
from fedfdp.algorithms import ALIDPFL, QFFL, ClientStateStore, Ditto, FedAvg, FedDyn, FedProx, Scaffold
from fedfdp.algorithms.ditto import personal_generator
from fedfdp.errors import ConfigError
from fedfdp.privacy import SampleLevelDP
from fedfdp.privacy.accounting import DPEvent, epsilon_of
from fedfdp.seeding import torch_generator
from fedfdp.types import ClientData, ClientUpdate, RoundContext
from tests.helpers import fit_resumable, flat, run_federation, tiny_client, tiny_data

MECHANISM = dict(sample_rate=0.2, max_grad_norm=0.5, noise_multiplier=1.0)
DP_LR = 1.0  # the retired twins' default learning rate, written out
NONDP = dict(lr=0.1, batch_size=32)


def private(lr: float = DP_LR, **mechanism) -> dict:
    """The options of a private run (the retired DP twins'): ``lr`` and the record-level mechanism."""
    return dict(lr=lr, privacy=SampleLevelDP(**{**MECHANISM, **mechanism}))


def acc():
    return [RDPAccounting()]


def same_model(a, b):
    return torch.equal(flat(a.global_model), flat(b.global_model))


# ---- degenerate equivalences ---------------------------------------------------------------------
@pytest.mark.parametrize("make, reference, callbacks", [
    (lambda: FedProx(mu=0.0, **NONDP), lambda: FedAvg(**NONDP), list),
    (lambda: FedProx(mu=0.0, **private(local_steps=3)), lambda: FedAvg(**private(local_steps=3)), acc),
    (lambda: Scaffold(freeze_control_variates=True, **NONDP), lambda: FedAvg(**NONDP), list),
    (lambda: Scaffold(freeze_control_variates=True, **private(local_steps=2)),
     lambda: FedAvg(**private(local_steps=2)), acc),
    (lambda: FedDyn(alpha=0.0, server_correction=False, **NONDP), lambda: FedAvg(**NONDP), list),
    (lambda: FedDyn(alpha=0.0, server_correction=False, **private(local_steps=2)),
     lambda: FedAvg(**private(local_steps=2)), acc),
], ids=["fedprox", "dp-fedprox", "scaffold", "dp-scaffold", "feddyn", "dp-feddyn"])
def test_degenerate_baseline_equals_fedavg_bitwise(make, reference, callbacks):
    a, _ = run_federation(make(), callbacks(), rounds=3)
    b, _ = run_federation(reference(), callbacks(), rounds=3)
    assert same_model(a, b)


@pytest.mark.parametrize("make, reference", [
    (lambda: FedProx(mu=0.5, **NONDP), lambda: FedAvg(**NONDP)),
    (lambda: Scaffold(**NONDP), lambda: FedAvg(**NONDP)),
    (lambda: Scaffold(**private()), lambda: FedAvg(**private())),
    (lambda: FedDyn(alpha=0.1, **private()), lambda: FedAvg(**private())),
], ids=["fedprox", "scaffold", "dp-scaffold", "dp-feddyn"])
def test_non_degenerate_baseline_differs_from_fedavg(make, reference):
    cbs = acc if reference().privacy is not None else list
    a, _ = run_federation(make(), cbs(), rounds=3)
    b, _ = run_federation(reference(), cbs(), rounds=3)
    assert not same_model(a, b)


def test_feddyn_client_with_alpha_zero_is_fedavg_but_server_correction_is_alpha_free():
    """α → 0: the client update is FedAvg's; the server's h/α = −Σ(1/N)Σ(w_i − w_t) remains."""
    data = _client_data()
    w0 = tiny_client().get_flat_params()
    ctx = RoundContext(round=0)
    dyn, avg = FedDyn(alpha=0.0, **NONDP), FedAvg(**NONDP)
    u_dyn = dyn.local_update(_client_at(w0), data, ctx, torch_generator(0, "t"))
    u_avg = avg.local_update(_client_at(w0), data, ctx, torch_generator(0, "t"))
    assert torch.equal(u_dyn.params, u_avg.params)
    dyn.num_clients = 4
    ups = [ClientUpdate(0, w0 + 1.0, 10), ClientUpdate(1, w0 - 3.0, 30)]
    target = dyn.aggregate(w0, ups, ctx)
    mean = weighted_mean([u.params for u in ups], [10, 30])
    assert torch.allclose(target, mean + (1.0 - 3.0) / 4)


@pytest.mark.parametrize("make, reference, callbacks", [
    (lambda: QFFL(q=0.0, **NONDP), lambda: FedAvg(**NONDP), lambda: [GlobalLossReporting()]),
    (lambda: QFFL(q=0.0, **private()), lambda: FedAvg(**private()),
     lambda: [NoisyGlobalLossReporting(loss_clip_rule="fixed"), RDPAccounting()]),
], ids=["qffl", "dp-qffl"])
def test_qffl_with_q_zero_is_fedavg(make, reference, callbacks):
    """q-FFL paper: q = 0 gives FedAvg (p_i-weighted average of the local models, all clients taking part)."""
    a, _ = run_federation(make(), callbacks(), rounds=1)
    b, _ = run_federation(reference(), callbacks(), rounds=1)
    assert torch.allclose(flat(a.global_model), flat(b.global_model), atol=1e-6)


def test_qffl_aggregate_matches_formula():
    w = torch.tensor([1.0, 2.0])
    ups = [ClientUpdate(0, torch.tensor([0.5, 2.0]), 1, reported_loss=2.0),
           ClientUpdate(1, torch.tensor([1.0, 1.0]), 3, reported_loss=0.5)]
    alg = QFFL(q=1.0, lr=0.5)  # L = 2
    dws = [2 * (w - u.params) for u in ups]  # p = (1/4, 3/4)
    num = 0.25 * 2.0 * dws[0] + 0.75 * 0.5 * dws[1]
    den = 0.25 * (dws[0].pow(2).sum() + 2 * 2.0) + 0.75 * (dws[1].pow(2).sum() + 2 * 0.5)
    assert torch.allclose(alg.aggregate(w, ups, RoundContext(0)), w - num / den)


@pytest.mark.parametrize("dp", [False, True], ids=["ditto", "dp-ditto"])
def test_ditto_with_lambda_zero_personal_model_is_local_training(dp):
    alg = Ditto(personal_weight=0.0, **private()) if dp else Ditto(personal_weight=0.0, **NONDP)
    local = FedAvg(**private()) if dp else FedAvg(**NONDP)
    fed, _ = run_federation(alg, acc() if dp else [], rounds=2)
    w0 = tiny_client().get_flat_params()
    for cid in range(fed.num_clients):
        v = w0
        for r in range(2):
            gen = personal_generator(fed.generator("client", r, cid))
            v = local.local_update(_client_at(v), fed.client_data(cid), RoundContext(r), gen).params
        assert torch.equal(alg.client_state.get(cid, "personal"), v)
    groups = alg.evaluation_groups(flat(fed.global_model), fed.num_clients)
    assert sorted(c for ids, _ in groups for c in ids) == list(range(fed.num_clients))


# ---- the data-independent terms reach the update ------------------------------------------------
def _client_data(cid: int = 0) -> ClientData:
    dm = tiny_data()
    dm.setup("fit")
    x, y = dm.client_train(cid)
    return ClientData(client_id=cid, x=x, y=y)


def _client_at(params):
    client = tiny_client()
    client.set_flat_params(params)
    return client


ONE_STEP_NONDP = dict(lr=0.1, local_mode="poisson_batch", sample_rate=0.5)


@pytest.mark.parametrize("dp", [False, True], ids=["plain", "private"])
@pytest.mark.parametrize("name", ["scaffold", "feddyn", "ditto"])
def test_term_reaches_the_update(name, dp):
    """One local step: w1(algorithm) = w1(FedAvg) − η·term, with the term built from preset state."""
    data, w0 = _client_data(), tiny_client().get_flat_params()
    lr = DP_LR if dp else ONE_STEP_NONDP["lr"]
    k = torch.linspace(-1, 1, w0.numel())
    ref = (FedAvg(**private()) if dp else FedAvg(**ONE_STEP_NONDP))
    if name == "scaffold":
        alg = Scaffold(**private()) if dp else Scaffold(**ONE_STEP_NONDP)
        alg.control = 2 * k
        alg.client_state.set(0, "c", k)
        expected = -lr * k  # c − c_i = k
    elif name == "feddyn":
        alg = FedDyn(alpha=0.3, **private()) if dp else FedDyn(alpha=0.3, **ONE_STEP_NONDP)
        alg.client_state.set(0, "grad_memory", k)
        expected = lr * k  # −∇L_i; the quadratic term is 0 at the first step
    else:
        alg = Ditto(personal_weight=0.7, **private()) if dp else Ditto(personal_weight=0.7, **ONE_STEP_NONDP)
        v0 = w0 + 0.01 * k
        alg.client_state.set(0, "personal", v0)
        gen = torch_generator(0, "t")
        alg.local_update(_client_at(w0), data, RoundContext(0), gen)
        pgen = personal_generator(torch_generator(0, "t"))
        plain = ref.local_update(_client_at(v0), data, RoundContext(0), pgen).params
        got = alg.client_state.get(0, "personal")
        assert torch.allclose(got - plain, -lr * 0.7 * (v0 - w0), atol=1e-6)
        return
    got = alg.local_update(_client_at(w0), data, RoundContext(0), torch_generator(0, "t")).params
    plain = ref.local_update(_client_at(w0), data, RoundContext(0), torch_generator(0, "t")).params
    assert torch.allclose(got - plain, expected, atol=1e-6)


def test_dp_fedprox_term_reaches_the_second_step():
    """Two DP steps: w2(prox) = w2(avg) − η μ (w1 − w0); the noise is the same, the term is added after it."""
    data, w0, mu = _client_data(), tiny_client().get_flat_params(), 0.4
    w1 = FedAvg(**private(local_steps=1)).local_update(_client_at(w0), data, RoundContext(0),
                                                       torch_generator(0, "p")).params
    w2 = FedAvg(**private(local_steps=2)).local_update(_client_at(w0), data, RoundContext(0),
                                                       torch_generator(0, "p")).params
    w2p = FedProx(mu=mu, **private(local_steps=2)).local_update(_client_at(w0), data, RoundContext(0),
                                                             torch_generator(0, "p")).params
    assert not torch.equal(w2, w2p)
    assert torch.allclose(w2p - w2, -DP_LR * mu * (w1 - w0), atol=1e-6)


def test_scaffold_control_variates_follow_option_two():
    data, w0 = _client_data(), tiny_client().get_flat_params()
    alg = Scaffold(**ONE_STEP_NONDP)
    alg.num_clients = 4
    up = alg.local_update(_client_at(w0), data, RoundContext(0), torch_generator(0, "s"))
    c_i = alg.client_state.get(0, "c")
    assert torch.allclose(c_i, (w0 - up.params) / (1 * 0.1))  # c = c_i = 0 before, K = 1
    alg.on_round_end([up], RoundContext(0))
    assert torch.allclose(alg.control, c_i / 4)


# ---- accounting -----------------------------------------------------------------------------------
def test_dp_qffl_requires_and_charges_the_global_loss_release():
    with pytest.raises(ConfigError, match="NoisyGlobalLossReporting"):
        run_federation(QFFL(**private()), [NoisyLossReporting(), RDPAccounting()], rounds=1)
    acct = RDPAccounting()
    fed, _ = run_federation(QFFL(**private()), [NoisyGlobalLossReporting(), acct], rounds=2)
    sigmas = {entry[0] for entry in acct.ledgers[0].accountant.history}
    assert sigmas == {MECHANISM["noise_multiplier"], 5.0}  # model steps and the loss release (σ_l = 5)
    plain = RDPAccounting()
    run_federation(FedAvg(**private()), [plain], rounds=2)
    assert acct.epsilon() > plain.epsilon()


def test_alidpfl_plans_worst_case_and_charges_actual_steps():
    alg = ALIDPFL(max_local_steps=4, **private())
    assert alg.planned_dp_events(0, 100)[0][1].steps == 4
    acct = RDPAccounting()
    fed, _ = run_federation(alg, [acct], rounds=3)
    taken = alg.local_steps
    assert 1 <= taken <= 4
    ref = RDPAccounting()
    run_federation(FedAvg(**private(local_steps=4)), [ref], rounds=3)
    assert acct.epsilon() <= ref.epsilon() + 1e-12


def test_alidpfl_step_rule_grows_when_mu_is_small():
    alg = ALIDPFL(max_local_steps=100, **private())
    alg.dim, alg.batch_hat = 10_000, 50.0
    assert alg.optimal_steps(0.01, 100) > alg.optimal_steps(10.0, 100) >= 1
    assert alg.optimal_steps(1e-6, 100) == 100


def test_ditto_dp_charges_both_phases():
    assert len(Ditto(**private()).planned_dp_events(0, 100)) == 2


# ---- client state ---------------------------------------------------------------------------------
def test_client_state_store_is_lazy_and_round_trips():
    store = ClientStateStore()
    assert store.get(3, "c") is None and store.clients() == [] and store.num_bytes() == 0
    store.get(3, "c", lambda: torch.ones(5))
    assert store.clients() == [3] and store.num_bytes() == 20
    buf = io.BytesIO()
    torch.save(store.state_dict(), buf)
    buf.seek(0)
    other = ClientStateStore()
    other.load_state_dict(torch.load(buf))
    assert torch.equal(other.get(3, "c"), torch.ones(5))


def test_only_clients_that_trained_hold_state():
    alg = Scaffold(**NONDP)
    run_federation(alg, [], rounds=1, clients_per_round=1, data=tiny_data(num_clients=4))
    assert len(alg.client_state.clients()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("make", [lambda: Scaffold(**private()), lambda: FedDyn(alpha=0.1, **private()),
                                  lambda: Ditto(**private())], ids=["scaffold", "feddyn", "ditto"])
def test_resume_restores_client_state_bitwise(tmp_path, make):
    """2 rounds, checkpoint, resume to 4 ≡ 4 rounds straight (control variates / memories / personal models)."""
    straight = fit_resumable(make, 4)
    fit_resumable(make, 2, tmp_path)
    resumed = fit_resumable(make, 4, tmp_path, str(tmp_path / "last.ckpt"))
    assert same_model(straight, resumed)
    a, b = straight.algorithm.state_dict(), resumed.algorithm.state_dict()
    assert a["clients"].keys() == b["clients"].keys() and a["clients"]
    for cid in a["clients"]:
        for name, tensor in a["clients"][cid].items():
            assert torch.equal(tensor, b["clients"][cid][name])


@pytest.mark.parametrize("bad, field", [(lambda: FedProx(mu=-1), "algorithm.mu"),
                                        (lambda: FedDyn(alpha=-1), "algorithm.alpha"),
                                        (lambda: QFFL(q=-1), "algorithm.q"),
                                        (lambda: ALIDPFL(max_local_steps=0, privacy=SampleLevelDP()),
                                         "algorithm.max_local_steps"),
                                        (lambda: Ditto(personal_weight=-1), "algorithm.personal_weight")])
def test_bad_hyper_parameters_name_the_field(bad, field):
    with pytest.raises(ConfigError, match=field):
        bad()


class _RecordingClient:
    """Records the local model after every step of the wrapped client."""

    def __init__(self, client):
        self.client, self.params = client, []

    def training_step(self, batch, batch_idx=0):
        out = self.client.training_step(batch, batch_idx)
        self.params.append(self.client.get_flat_params())
        return out

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_fedprox_term_reaches_the_second_plain_step():
    """Two mini-batch steps: w2(prox) = w2(avg) − η μ (w1 − w0) (same batches, same gradient at w1)."""
    data, w0, mu = _client_data(), tiny_client().get_flat_params(), 0.4
    batch = (data.size + 1) // 2
    rec = _RecordingClient(_client_at(w0))
    FedAvg(lr=0.1, batch_size=batch).local_update(rec, data, RoundContext(0), torch_generator(0, "q"))
    assert len(rec.params) == 2
    w1, w2 = rec.params
    w2p = FedProx(mu=mu, lr=0.1, batch_size=batch).local_update(_client_at(w0), data, RoundContext(0),
                                                               torch_generator(0, "q")).params
    assert torch.allclose(w2p - w2, -0.1 * mu * (w1 - w0), atol=1e-6)


def test_ditto_with_a_private_personal_model_charges_only_the_global_update():
    """private_personal=False: the personal model never leaves the client, so one event per round
    (ε equals DP-FedAvg's, DP-Ditto's default pays more), the global model is the default's bit for
    bit (the personal phase has its own stream), and the personal models moved by plain SGD steps."""
    alg = Ditto(private_personal=False, personal_lr=0.05, **private())
    assert len(alg.planned_dp_events(0, 100)) == 1
    kept, ref, both = RDPAccounting(), RDPAccounting(), RDPAccounting()
    fed, _ = run_federation(alg, [kept], rounds=2)
    dpfedavg, _ = run_federation(FedAvg(**private()), [ref], rounds=2)  # (its stream differs: no personal draw)
    default, _ = run_federation(Ditto(**private()), [both], rounds=2)
    assert same_model(fed, default)
    assert kept.epsilon() == pytest.approx(ref.epsilon(), rel=1e-12)
    # the default charges each of its two DP-SGD steps per round once: 2 rounds x 2 steps
    two_steps = DPEvent(noise_multiplier=MECHANISM["noise_multiplier"], sample_rate=MECHANISM["sample_rate"], steps=4)
    assert both.epsilon() == pytest.approx(epsilon_of([two_steps], both.delta), rel=1e-12)
    w = flat(fed.global_model)
    assert alg.client_state.clients()
    for cid in alg.client_state.clients():
        v = alg.client_state.get(cid, "personal")
        assert torch.isfinite(v).all() and not torch.equal(v, w)


def test_ditto_private_personal_lr_is_used_and_plain_personal_needs_a_step_size():
    with pytest.raises(ConfigError, match="personal_lr"):
        Ditto(private_personal=False, **private())
    with pytest.raises(ConfigError, match="personal_steps"):
        Ditto(personal_steps=3, **private())  # private personal steps would need their own events
    one, three = (Ditto(private_personal=False, personal_lr=0.05, personal_steps=k, **private()) for k in (1, 3))
    run_federation(one, acc(), rounds=1)
    run_federation(three, acc(), rounds=1)
    assert len(three.planned_dp_events(0, 100)) == 1 and three.planned_dp_events(0, 100)[0][1].steps == 1
    assert not torch.equal(one.client_state.get(0, "personal"), three.client_state.get(0, "personal"))
    a, _ = run_federation(Ditto(personal_lr=0.5, **private()), acc(), rounds=1)
    b, _ = run_federation(Ditto(**private()), acc(), rounds=1)
    assert same_model(a, b)  # the global phase is unchanged
    pa, pb = (alg.client_state.get(0, "personal") for alg in (a.algorithm, b.algorithm))
    assert not torch.equal(pa, pb)


def test_ditto_refuses_a_personal_step_whose_proximal_term_overshoots():
    """v ← v − lr·λ(v − w_t) grows without bound when lr·λ > 2 (a DP-Ditto run at lr 40, λ 0.1 ended at
    chance accuracy): refused with one line naming both fields."""
    with pytest.raises(ConfigError, match=r"personal_lr × personal_weight = 40 × 0.1 = 4 must be < 2"):
        Ditto(personal_weight=0.1, **private(lr=40.0, sample_rate=0.1, max_grad_norm=0.1, noise_multiplier=2.0))
    Ditto(personal_weight=0.01, personal_lr=20.0,
          **private(lr=40.0, sample_rate=0.1, max_grad_norm=0.1, noise_multiplier=2.0))
