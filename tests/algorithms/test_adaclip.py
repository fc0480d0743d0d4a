"""Bounded adaptive clipping (DPFedAvgAdaClip): update rule, sensitivity, accounting, state, command line."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from callbacks import FederationCallback, RDPAccounting
from fedfdp import Federation
from fedfdp.algorithms import DPFedAvgAdaClip, FedAvg
from fedfdp.algorithms.adaclip import CLIP_COUNT_RELEASE
from fedfdp.errors import ConfigError
from fedfdp.fit import main
from fedfdp.privacy import SampleLevelDP
from fedfdp.privacy.accounting import DPEvent, epsilon_of
from fedfdp.privacy.adaptive_clipping import (CountingFlatClip, next_clip_bound, split_noise_multiplier,
                                              unclipped_fraction_estimate)
from fedfdp.seeding import poisson_mask, randn
from fedfdp.types import MODEL_RELEASE, ClientData, ClientUpdate, RoundContext
from tests.conftest import REPO
from tests.helpers import flat, run_federation, tiny_client, tiny_data

MECHANISM = dict(sample_rate=0.2, max_grad_norm=0.5, noise_multiplier=1.0)
ADA = dict(min_clip_bound=0.05, max_clip_bound=5.0, count_noise_std=2.0)
SCOPES = pytest.mark.parametrize("scope", ["global", "client"])
TINY = str(REPO / "tests" / "configs" / "tiny_adaclip.yaml")


class _Record(FederationCallback):
    """Records every (round, client, kind, event) the server sees and the bounds after each round."""

    def __init__(self) -> None:
        self.events: list = []
        self.bounds: list[dict[int, float]] = []
        self.used: list[float] = []

    def on_before_aggregate(self, trainer, federation, updates):
        self.events += [(federation.current_round, u.client_id, kind, e) for u in updates for kind, e in u.dp_events]
        self.used += [u.diagnostics["clip_bound"] for u in updates if "clip_bound" in u.diagnostics]

    def on_round_end(self, trainer, federation, context, updates, metrics):
        algorithm = federation.algorithm
        self.bounds.append({c: algorithm.bound(c) for c in range(3)} if hasattr(algorithm, "bound") else {})


def dp_fedavg(lr: float = 0.5, **mechanism) -> FedAvg:
    """DP-FedAvg (FedAvg with the record-level mechanism) at this file's mechanism settings."""
    return FedAvg(lr=lr, privacy=SampleLevelDP(**{**MECHANISM, **mechanism}))


def adaclip(lr: float = 0.5, local_steps: int = 1, **options) -> DPFedAvgAdaClip:
    """DPFedAvgAdaClip at this file's settings (C_0 = 0.5, σ = 1) with ``options`` over :data:`ADA`."""
    return DPFedAvgAdaClip(lr=lr, privacy=SampleLevelDP(**MECHANISM, local_steps=local_steps), **{**ADA, **options})


def tiny_data_client() -> ClientData:
    return ClientData(client_id=0, x=torch.randn(20, 1, 8, 8), y=torch.randint(0, 4, (20,)))


def _fit(algorithm, rounds=3, **kwargs):
    accountant, record = RDPAccounting(), _Record()
    fed, _ = run_federation(algorithm, [accountant, record], rounds=rounds, **kwargs)
    return fed, accountant, record


# ---- the update rule -----------------------------------------------------------------------------------
def test_update_rule_is_the_bounded_geometric_step():
    # f̃ = 0.8 > γ = 0.5: shrink by exp(−0.2 · 0.3)
    assert next_clip_bound(2.0, 0.8, target_quantile=0.5, clip_lr=0.2, min_bound=0.1, max_bound=10.0) == \
        pytest.approx(2.0 * math.exp(-0.06), rel=1e-15)
    # f̃ = 0.1 < γ = 0.6: grow by exp(0.2 · 0.5)
    assert next_clip_bound(1.0, 0.1, target_quantile=0.6, clip_lr=0.2, min_bound=0.1, max_bound=10.0) == \
        pytest.approx(math.exp(0.1), rel=1e-15)
    # f̃ = γ: unchanged; η_C = 0: unchanged
    assert next_clip_bound(1.5, 0.5, target_quantile=0.5, clip_lr=0.2, min_bound=0.1, max_bound=10.0) == 1.5
    assert next_clip_bound(1.5, 1.0, target_quantile=0.5, clip_lr=0.0, min_bound=0.1, max_bound=10.0) == 1.5
    # clamps: 9.5 · e^{0.1} = 10.499 → 10; 0.105 · e^{−0.1} = 0.095 → 0.1
    assert next_clip_bound(9.5, 0.0, target_quantile=0.5, clip_lr=0.2, min_bound=0.1, max_bound=10.0) == 10.0
    assert next_clip_bound(0.105, 1.0, target_quantile=0.5, clip_lr=0.2, min_bound=0.1, max_bound=10.0) == 0.1


def test_the_unclipped_fraction_is_the_uncentred_noisy_count_over_the_expected_batch():
    # b̃ = Σ(b_j − ½) + ξ; f̃ = b̃/(q|D|) + ½, clamped to [0, 1]
    assert unclipped_fraction_estimate(3.0, 20.0) == pytest.approx(0.65)
    assert unclipped_fraction_estimate(-10.0, 20.0) == 0.0
    assert unclipped_fraction_estimate(-50.0, 20.0) == 0.0  # noise can push it below 0
    assert unclipped_fraction_estimate(50.0, 20.0) == 1.0


def test_one_client_step_matches_a_hand_computation():
    """Replay the step's random draws (mask, model noise, count noise) and the count by hand."""
    torch.manual_seed(0)
    algorithm = adaclip(bound_scope="client")
    client = tiny_client()
    data = ClientData(client_id=0, x=torch.randn(120, 1, 8, 8), y=torch.randint(0, 4, (120,)))
    w0 = client.get_flat_params()
    gen = torch.Generator().manual_seed(7)
    mask = poisson_mask(data.size, 0.2, gen)
    norms = client.engine.compute(data.x[mask], data.y[mask]).norms
    bound = float(norms.median())  # the client's current C_i: about half its samples unclipped
    algorithm.bounds[0] = bound
    unclipped = int((norms <= bound).sum())
    randn((w0.numel(),), gen)  # the model noise
    count_noise = float(randn((), gen, dtype=torch.float64))
    noisy = unclipped - 0.5 * int(mask.sum()) + 2.0 * count_noise
    fraction = min(1.0, max(0.0, noisy / (0.2 * 120) + 0.5))
    expected = min(5.0, max(0.05, bound * math.exp(-0.2 * (fraction - 0.5))))

    update = algorithm.local_update(client, data, RoundContext(round=0), torch.Generator().manual_seed(7))
    assert float(update.extras["adaclip_bound"]) == pytest.approx(expected, rel=1e-12)
    assert update.diagnostics["unclipped_fraction_noisy"] == pytest.approx(fraction, rel=1e-12)
    assert update.diagnostics["clip_bound"] == bound
    assert float(update.extras["adaclip_count"]) == pytest.approx(noisy, rel=1e-12)
    assert 0 < unclipped < int(mask.sum()) and 0 < fraction < 1  # a real count, not an edge case
    assert expected != bound


def test_the_global_bound_is_updated_from_the_summed_noisy_counts():
    """(A4')-(A5): f̃ = Σ_i b̃_i / (τ Σ_i q|D_i|) + ½ over the round's uploads, one update per round."""
    algorithm = adaclip(local_steps=2)  # global scope, C_0 = 0.5
    updates = [ClientUpdate(client_id=i, params=torch.zeros(1), num_examples=n,
                            extras={"adaclip_count": torch.tensor(b, dtype=torch.float64)})
               for i, (n, b) in enumerate([(100, 7.5), (300, -20.0)])]
    metrics = algorithm.on_round_end(updates, RoundContext(round=0))
    fraction = (7.5 - 20.0) / (2 * 0.2 * (100 + 300)) + 0.5  # = 0.421875
    assert metrics["unclipped_fraction_noisy"] == pytest.approx(fraction, rel=1e-15)
    assert algorithm.global_bound == pytest.approx(0.5 * math.exp(-0.2 * (fraction - 0.5)), rel=1e-15)
    assert algorithm.bound(0) == algorithm.bound(7) == algorithm.global_bound == metrics["clip_bound_mean"]
    assert algorithm.bounds == {}


# ---- sensitivity ---------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(norms=st.lists(st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=1e12, allow_nan=False)),
                      min_size=0, max_size=40),
       bound=st.floats(min_value=1e-4, max_value=1e3))
def test_every_clipped_norm_is_at_most_the_bound_and_the_count_is_exact(norms, bound):
    rule = CountingFlatClip(bound)
    t = torch.tensor(norms + [bound], dtype=torch.float32)  # and one norm exactly at the bound
    factors = rule(torch.zeros_like(t), t)
    assert bool(((factors * t) <= bound * (1 + 1e-6)).all())
    assert bool(((factors >= 0) & (factors <= 1)).all())
    assert rule.unclipped == int((t <= bound).sum()) and rule.size == len(norms) + 1


@settings(max_examples=15, deadline=None)
@given(scale=st.floats(min_value=1e-3, max_value=1e3), seed=st.integers(0, 10_000))
@example(scale=712.2986028692753, seed=98)  # a CI draw where the recomputed gradient is 1.06e-4 off
def test_each_sample_contributes_at_most_the_current_bound_in_the_real_step(scale, seed):
    """Each record's contribution to the released sum (the engine's own weighted sum, one record at a
    time) has norm ≤ C_i, whatever the inputs and whichever bound the client has reached; the true
    per-sample gradients (one backward each) times the step's factors agree to float32 rounding."""
    torch.manual_seed(seed)
    algorithm = adaclip(bound_scope="client")
    algorithm.bounds[0] = float(torch.empty(()).uniform_(0.05, 5.0))
    client = tiny_client()
    data = ClientData(client_id=0, x=scale * torch.randn(40, 1, 8, 8), y=torch.randint(0, 4, (40,)))
    batch = algorithm.step_batch(data, algorithm.bound(0), torch.Generator().manual_seed(seed))
    result = client.engine.compute(batch.x, batch.y)
    factors = batch.clip_rule(result.losses, result.norms)
    params = client.trainable_parameters()
    for j in range(batch.y.shape[0]):
        weights = torch.zeros_like(factors)
        weights[j] = factors[j]
        released = torch.cat([g.flatten() for g in result.weighted_sum(weights)])
        assert float(released.norm()) <= algorithm.bound(0) * (1 + 1e-5)
        loss = client.per_sample_loss(client(batch.x[j:j + 1]), batch.y[j:j + 1]).sum()
        grad = torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])
        # an independent float32 recomputation: inputs up to 1e3 amplify rounding (measured 1.06e-4)
        assert float((factors[j] * grad).norm()) <= algorithm.bound(0) * (1 + 1e-3)
    assert batch.noise_multiplier == pytest.approx(split_noise_multiplier(1.0, 2.0))
    assert batch.clip_rule.max_grad_norm == algorithm.bound(0)


# ---- the bounds stay in [C_min, C_max] -----------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(start=st.floats(0.05, 5.0), fractions=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=50),
       gamma=st.floats(0.0, 1.0), clip_lr=st.floats(0.0, 50.0))
def test_the_update_never_leaves_the_bounds(start, fractions, gamma, clip_lr):
    bound = start
    for f in fractions:
        bound = next_clip_bound(bound, f, target_quantile=gamma, clip_lr=clip_lr, min_bound=0.05, max_bound=5.0)
        assert 0.05 <= bound <= 5.0


@SCOPES
@pytest.mark.parametrize(("gamma", "low", "clamp"), [(1.0, 0.05, 5.0), (0.0, 0.49, 0.49)], ids=["up", "down"])
def test_in_training_the_bounds_reach_the_clamp_and_never_leave_the_range(gamma, low, clamp, scope):
    """A large η_C drives the bounds into a clamp (γ = 1 pushes up to C_max, γ = 0 down to C_min)."""
    fed, _, record = _fit(adaclip(target_quantile=gamma, clip_lr=5.0, bound_scope=scope, min_clip_bound=low), rounds=3)
    seen = [b for bounds in record.bounds for b in bounds.values()] + record.used
    assert all(low <= b <= 5.0 for b in seen)
    assert clamp in seen


# ---- privacy: declared releases and charged events -----------------------------------------------------
def test_split_accounting_charges_exactly_dp_fedavgs_events_and_epsilon():
    reference, ref_acc, ref_record = _fit(dp_fedavg())
    fed, acc, record = _fit(adaclip())
    assert record.events == ref_record.events and record.events
    assert {c: led.events for c, led in acc.ledgers.items()} == {c: led.events for c, led in ref_acc.ledgers.items()}
    assert acc.epsilon() == ref_acc.epsilon() > 0
    assert fed.planned_dp_events(0) == reference.planned_dp_events(0) == \
        [(MODEL_RELEASE, DPEvent(noise_multiplier=1.0, sample_rate=0.2))]
    # σ_Δ^{-2} + (2σ_b)^{-2} = σ^{-2}: the pair is one SGM(q, σ); the model itself carries more noise
    sigma_delta = fed.algorithm.model_noise_multiplier
    assert sigma_delta ** -2 + (2 * 2.0) ** -2 == pytest.approx(1.0 ** -2, rel=1e-12)
    assert sigma_delta > 1.0
    assert [r.noise_multiplier for r in fed.algorithm.dp_releases()] == [1.0, 4.0]  # the charged σ, the count's
    assert fed.algorithm.step_batch(tiny_data_client(), 0.5, torch.Generator()).noise_multiplier == sigma_delta
    assert not torch.equal(flat(fed.global_model), flat(reference.global_model))


def test_separate_accounting_charges_the_count_as_its_own_event():
    _, ref_acc, _ = _fit(dp_fedavg())
    fed, acc, record = _fit(adaclip(count_accounting="separate"))
    count = DPEvent(noise_multiplier=4.0, sample_rate=0.2)  # centred count: sensitivity 1/2, σ_b = 2
    model = DPEvent(noise_multiplier=1.0, sample_rate=0.2)
    assert fed.planned_dp_events(1) == [(MODEL_RELEASE, model), (CLIP_COUNT_RELEASE, count)]
    assert sorted(record.events, key=repr) == sorted(
        [(t, c, kind, e) for t in range(3) for c in range(3)
         for kind, e in ((MODEL_RELEASE, model), (CLIP_COUNT_RELEASE, count))], key=repr)
    assert fed.algorithm.model_noise_multiplier == 1.0
    assert acc.epsilon() == pytest.approx(epsilon_of([model.repeated(3), count.repeated(3)], 1e-5), rel=1e-12)
    assert acc.epsilon() > ref_acc.epsilon()


def test_adaptation_off_is_dp_fedavg_at_the_normalised_step_bit_for_bit():
    reference, ref_acc, ref_record = _fit(dp_fedavg(lr=0.5 / 0.5))
    fed, acc, record = _fit(adaclip(adaptive=False))
    assert torch.equal(flat(fed.global_model), flat(reference.global_model))
    assert record.events == ref_record.events and acc.epsilon() == ref_acc.epsilon()
    assert fed.algorithm.dp_releases() == reference.algorithm.dp_releases()
    unnormalised, _, _ = _fit(adaclip(adaptive=False, normalized_clipping=False))
    plain, _, _ = _fit(dp_fedavg())
    assert torch.equal(flat(unnormalised.global_model), flat(plain.global_model))


def test_the_zero_count_noise_is_refused_with_one_line():
    with pytest.raises(ConfigError, match=r"algorithm\.count_noise_std must be > privacy\.noise_multiplier/2 = 0\.5 "
                                          r"with count_accounting 'split' \(Andrew et al\. Theorem 1\), got 0\.0") as err:
        adaclip(count_noise_std=0.0)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"algorithm\.count_noise_std=0\.0: the unclipped-count release would be "
                                          r"released without noise") as err:
        run_federation(adaclip(count_accounting="separate", count_noise_std=0.0),
                       [RDPAccounting()], rounds=1)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("options", "message"), [
    (dict(target_quantile=1.5), r"algorithm\.target_quantile must be in \[0, 1\], got 1\.5"),
    (dict(clip_lr=-0.1), r"algorithm\.clip_lr must be finite and >= 0, got -0\.1"),
    (dict(min_clip_bound=0.0), r"algorithm\.min_clip_bound must be in \(0, privacy\.max_grad_norm=0\.5\], got 0\.0"),
    (dict(min_clip_bound=0.6), r"algorithm\.min_clip_bound must be in \(0, privacy\.max_grad_norm=0\.5\], got 0\.6"),
    (dict(max_clip_bound=math.inf),
     r"algorithm\.max_clip_bound must be finite and >= privacy\.max_grad_norm=0\.5, got inf"),
    (dict(max_clip_bound=0.4),
     r"algorithm\.max_clip_bound must be finite and >= privacy\.max_grad_norm=0\.5, got 0\.4"),
    (dict(count_noise_std=math.inf), r"algorithm\.count_noise_std must be finite and >= 0, got inf"),
    (dict(count_noise_std=-1.0), r"algorithm\.count_noise_std must be finite and >= 0, got -1\.0"),
    (dict(count_noise_std=0.4), r"algorithm\.count_noise_std must be > privacy\.noise_multiplier/2 = 0\.5"),
    (dict(count_accounting="joint"), r"algorithm\.count_accounting must be one of \['split', 'separate'\]"),
    (dict(bound_scope="server"), r"algorithm\.bound_scope must be one of \['global', 'client'\], got 'server'"),
], ids=["gamma", "clip_lr", "cmin0", "cmin>c0", "cmax-inf", "cmax<c0", "sb-inf", "sb<0", "split-sb", "accounting",
        "scope"])
def test_bad_options_are_refused_with_one_line(options, message):
    with pytest.raises(ConfigError, match=message) as err:
        adaclip(**options)
    assert "\n" not in str(err.value)


# ---- state ---------------------------------------------------------------------------------------------
@SCOPES
def test_resume_from_a_checkpoint_continues_the_bounds_exactly(tmp_path, scope):
    """2 rounds, checkpoint, resume to 4 ≡ 4 rounds straight: model and every bound bit for bit."""
    def make(rounds, ckpt_dir=None):
        callbacks = [RDPAccounting()]
        if ckpt_dir is not None:
            callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=1))
        fed = Federation(tiny_client(), adaclip(bound_scope=scope), num_rounds=rounds, seed=1)
        trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                          max_epochs=-1, enable_checkpointing=ckpt_dir is not None, callbacks=callbacks)
        return fed, trainer

    straight, t1 = make(4)
    t1.fit(straight, datamodule=tiny_data())
    first, t2 = make(2, tmp_path)
    t2.fit(first, datamodule=tiny_data())
    def bounds(fed):
        return [fed.algorithm.bound(c) for c in range(3)]

    assert bounds(first) != bounds(straight)  # the bounds moved after round 2
    resumed, t3 = make(4, tmp_path)
    t3.fit(resumed, datamodule=tiny_data(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert t3.global_step == 4
    assert bounds(resumed) == bounds(straight)
    assert resumed.algorithm.state_dict() == straight.algorithm.state_dict()
    assert torch.equal(flat(straight.global_model), flat(resumed.global_model))


def test_the_bounds_travel_with_the_round_context():
    """The server broadcasts the bounds; a client steps at the broadcast bound, holding no state."""
    algorithm = adaclip()
    algorithm.global_bound = 0.8
    assert algorithm.configure_round(3).broadcast == {"clip_bound": 0.8}
    context = RoundContext(round=3, broadcast={"clip_bound": 0.3})
    update = algorithm.local_update(tiny_client(), tiny_data_client(), context, torch.Generator().manual_seed(0))
    assert update.diagnostics["clip_bound"] == 0.3
    fed, _, _ = _fit(adaclip(bound_scope="client"), rounds=2)
    assert fed.algorithm.configure_round(2).broadcast == {f"clip_bound/{c}": fed.algorithm.bound(c) for c in range(3)}


@SCOPES
def test_stacked_and_client_by_client_rounds_agree(scope):
    stacked, _, rec_s = _fit(adaclip(bound_scope=scope), stacked_round=True)
    single, _, rec_1 = _fit(adaclip(bound_scope=scope), stacked_round=False)
    assert rec_s.bounds == rec_1.bounds
    torch.testing.assert_close(flat(stacked.global_model), flat(single.global_model))


@SCOPES
def test_several_local_steps_in_lockstep_agree_with_client_by_client(scope, monkeypatch):
    """3 steps a round, the count of each released after its step (client scope: the bound moves
    within the round): the step written once gives the same bounds and model on both schedulers."""
    from fedfdp.stacked import StackedRound

    monkeypatch.setattr(StackedRound, "lockstep_on_cpu", True)
    make = lambda: adaclip(local_steps=3, clip_lr=1.0, bound_scope=scope)  # noqa: E731
    assert make().stackable_step(RoundContext(0)) is not None
    stacked, acc_s, rec_s = _fit(make(), stacked_round=True)
    single, acc_1, rec_1 = _fit(make(), stacked_round=False)
    assert rec_s.bounds == rec_1.bounds and rec_s.used == rec_1.used and acc_s.epsilon() == acc_1.epsilon()
    torch.testing.assert_close(flat(stacked.global_model), flat(single.global_model))


def test_several_local_steps_adapt_a_client_bound_after_every_step():
    fed, acc, record = _fit(adaclip(local_steps=3, clip_lr=1.0, bound_scope="client"), rounds=1)
    assert all(e == DPEvent(noise_multiplier=1.0, sample_rate=0.2, steps=3) for _, _, _, e in record.events)
    # the upload's mean bound over its 3 steps differs from C_0: the bound moved within the round
    assert all(u != 0.5 for u in record.used)


def test_round_metrics_cover_every_client():
    fed, _, _ = _fit(adaclip(bound_scope="client"), rounds=2, clients_per_round=1)
    metrics = fed.algorithm.on_round_end([], RoundContext(round=2))
    bounds = [fed.algorithm.bound(c) for c in range(3)]
    assert bounds.count(0.5) >= 1 and len(fed.algorithm.bounds) in (1, 2)  # unsampled clients hold C_0
    assert metrics["clip_bound_mean"] == pytest.approx(sum(bounds) / 3)
    assert (metrics["clip_bound_min"], metrics["clip_bound_max"]) == (min(bounds), max(bounds))


# ---- command line --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_tiny_run_from_the_command_line_logs_the_bounds_and_charges_the_ledger(tmp_path):
    """``python -m fedfdp.fit --config tests/configs/tiny_adaclip.yaml`` (its ``main``, in process: the
    module entry point itself is covered by tests/cli/test_cli.py)."""
    run_dir = tmp_path / "run"
    assert main(["--config", TINY, "--run_dir", str(run_dir), "--wandb", "disabled"]) == 0
    with (run_dir / "metrics.csv").open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("clip_bound_mean")]
    assert len(rows) == 3
    for row in rows:
        low, mean, high = (float(row[f"clip_bound_{k}"]) for k in ("min", "mean", "max"))
        assert 0.05 <= low <= mean <= high <= 5.0
        assert 0.0 <= float(row["client_unclipped_fraction_noisy"]) <= 1.0
    ledger = [json.loads(line) for line in (run_dir / "privacy_ledger.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["sigma"], e["q"]) for e in ledger] == [("model", 1.0, 0.2)] * 9
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epsilon"] == pytest.approx(
        epsilon_of([DPEvent(noise_multiplier=1.0, sample_rate=0.2, steps=3)], 1e-5), rel=1e-9)


def test_the_command_line_refuses_a_noiseless_count_with_one_error_line(tmp_path, capsys):
    code = main(["--config", TINY, "--run_dir", str(tmp_path / "run"),
                 "--model.algorithm.init_args.count_accounting", "separate",
                 "--model.algorithm.init_args.count_noise_std", "0"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "count_noise_std=0.0" in errors[0]
    assert not (tmp_path / "run").exists()


def test_the_adaptive_clipping_maths_doctests_hold():
    import doctest

    from fedfdp.privacy import adaptive_clipping

    result = doctest.testmod(adaptive_clipping)
    assert result.attempted >= 3 and result.failed == 0
