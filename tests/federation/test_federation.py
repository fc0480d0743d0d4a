"""The federation loop end to end on tiny synthetic data: equivalences, hooks, accounting, budget."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer

from callbacks.base import run_accountant_of
from callbacks import FederationCallback, LossReporting, NoisyLossReporting, RDPAccounting
from fedfdp import FedAvg, FedFair, FedFDP, Federation
from fedfdp.errors import ConfigError
from fedfdp.privacy import SampleLevelDP
from fedfdp.privacy.accounting import DPEvent, epsilon_of
from fedfdp.privacy.planning import max_rounds
from tests.helpers import flat, run_federation, tiny_client, tiny_data

MECHANISM = dict(sample_rate=0.2, max_grad_norm=0.5, noise_multiplier=1.0)


def dp(**mechanism) -> dict:
    """lr 1.0 and sample-level DP (``MECHANISM``, with ``mechanism`` changed): DP-FedAvg is FedAvg(**dp())."""
    return dict(lr=1.0, privacy=SampleLevelDP(**{**MECHANISM, **mechanism}))


class Recorder(FederationCallback):
    """Records the federation hooks in call order."""

    def __init__(self):
        self.calls: list[str] = []

    def on_round_start(self, trainer, federation, context, client_ids):
        self.calls.append(f"round_start:{context.round}")

    def on_client_update(self, trainer, federation, client, data, update):
        self.calls.append(f"client:{data.client_id}")

    def on_before_aggregate(self, trainer, federation, updates):
        self.calls.append("before_aggregate")

    def on_round_end(self, trainer, federation, context, updates, metrics):
        self.calls.append("round_end")

    def on_evaluate(self, trainer, federation, result, metrics):
        self.calls.append(f"evaluate:{result.round}")


def test_hook_order_and_round_counter():
    rec = Recorder()
    fed, trainer = run_federation(FedAvg(lr=0.1, batch_size=32), [rec], rounds=2, eval_every=2)
    assert trainer.global_step == 2
    one_round = ["client:0", "client:1", "client:2", "before_aggregate", "round_end"]
    assert rec.calls == ["round_start:0", *one_round, "round_start:1", *one_round, "evaluate:2"]


def test_fedfdp_with_lambda_zero_equals_dp_fedavg_bitwise():
    fdp, _ = run_federation(FedFDP(fairness_weight=0.0, **dp()), [NoisyLossReporting(), RDPAccounting()], rounds=3)
    dpfedavg, _ = run_federation(FedAvg(**dp()), [NoisyLossReporting(), RDPAccounting()], rounds=3)
    assert torch.equal(flat(fdp.global_model), flat(dpfedavg.global_model))


def test_fairness_weight_changes_the_model():
    loose = dict(max_grad_norm=100.0)  # clip inactive: the factor is 1 + λ(ℓ_j − F̄), not C/‖g_j‖
    fdp, _ = run_federation(FedFDP(fairness_weight=1.0, **dp(**loose)), [NoisyLossReporting(), RDPAccounting()],
                            rounds=3)
    dpfedavg, _ = run_federation(FedAvg(**dp(**loose)), [NoisyLossReporting(), RDPAccounting()], rounds=3)
    assert not torch.equal(flat(fdp.global_model), flat(dpfedavg.global_model))


def test_dp_fedavg_without_noise_equals_fedavg_sgd():
    """σ = 0, huge C, realized-size normalisation ≡ FedAvg with one plain SGD step on the same Poisson batch."""
    acct = RDPAccounting(allow_non_private=True)  # refused without the explicit opt-in
    mechanism = SampleLevelDP(sample_rate=0.3, max_grad_norm=1e9, noise_multiplier=0.0, normalize_by="realized")
    dpfedavg, _ = run_federation(FedAvg(lr=0.5, privacy=mechanism), [acct], rounds=2)
    assert acct.epsilon() == float("inf")  # noiseless releases are not private
    plain, _ = run_federation(FedAvg(lr=0.5, sample_rate=0.3, local_mode="poisson_batch"), [], rounds=2)
    torch.testing.assert_close(flat(dpfedavg.global_model), flat(plain.global_model), rtol=1e-5, atol=1e-6)


def test_server_sgd_lr1_is_weighted_average_of_client_models():
    class Capture(FederationCallback):
        def on_before_aggregate(self, trainer, federation, updates):
            self.updates = [(u.params.clone(), u.num_examples) for u in updates]

    cap = Capture()
    fed, _ = run_federation(FedAvg(lr=0.1, batch_size=16), [cap], rounds=1)
    total = sum(n for _, n in cap.updates)
    expected = sum(p * (n / total) for p, n in cap.updates)
    torch.testing.assert_close(flat(fed.global_model), expected, rtol=1e-5, atol=1e-6)


def test_every_release_is_charged_to_the_accountant():
    acct = RDPAccounting(delta=1e-5)
    fed, _ = run_federation(FedFDP(**dp()), [NoisyLossReporting(noise_multiplier=3.0), acct], rounds=3)
    expected = [DPEvent(noise_multiplier=1.0, sample_rate=0.2, steps=3),
                DPEvent(noise_multiplier=3.0, sample_rate=0.2, steps=3)]
    for cid in range(3):
        assert acct.ledgers[cid].num_events == 6
        assert acct.ledgers[cid].epsilon(1e-5) == pytest.approx(epsilon_of(expected, 1e-5))


def test_cached_epsilon_is_the_max_over_ledgers_with_sampled_clients_and_after_restore():
    """ε is refreshed only for the round's clients; it must still equal a fresh max over every ledger."""
    acct = RDPAccounting(delta=1e-5)
    fed, _ = run_federation(FedFDP(**dp()), [NoisyLossReporting(), acct], rounds=5, clients_per_round=2,
                            data=tiny_data(num_clients=6))
    fresh = {cid: led.epsilon(1e-5) for cid, led in acct.ledgers.items()}
    assert 2 <= len(fresh) <= 6 and len({round(e, 9) for e in fresh.values()}) >= 1
    assert acct.epsilon() == max(fresh.values())
    assert all(acct.client_epsilon(c) == fresh.get(c, 0.0) for c in range(6))
    restored = RDPAccounting(delta=1e-5)
    restored.load_state_dict(acct.state_dict())
    assert restored.epsilon() == acct.epsilon() and restored.budgeted_epsilon() == acct.budgeted_epsilon()


def test_budget_stops_the_run_and_is_never_exceeded():
    target = 6.0
    acct = RDPAccounting(target_epsilon=target, delta=1e-5)
    fed, trainer = run_federation(FedFDP(**dp()), [NoisyLossReporting(), acct], rounds=None)
    per_round = [DPEvent(noise_multiplier=1.0, sample_rate=0.2), DPEvent(noise_multiplier=5.0, sample_rate=0.2)]
    limit = max_rounds(per_round, target_epsilon=target, delta=1e-5)
    assert trainer.global_step == limit
    assert acct.epsilon() <= target
    assert epsilon_of([e.repeated(limit + 1) for e in per_round], 1e-5) > target


def test_model_only_mode_budgets_gradient_steps_but_logs_true_epsilon():
    acct = RDPAccounting(target_epsilon=6.0, delta=1e-5, accounting_mode="model_only")
    fed, trainer = run_federation(FedFDP(**dp()), [NoisyLossReporting(noise_multiplier=1.0), acct], rounds=None)
    assert trainer.global_step == max_rounds([DPEvent(noise_multiplier=1.0, sample_rate=0.2)],
                                             target_epsilon=6.0, delta=1e-5)
    assert acct.budgeted_epsilon() <= 6.0
    assert acct.epsilon() > acct.budgeted_epsilon()  # the loss releases are still logged
    both = [DPEvent(noise_multiplier=1.0, sample_rate=0.2)] * 2
    assert trainer.global_step > max_rounds(both, target_epsilon=6.0, delta=1e-5)


@pytest.mark.parametrize("algorithm, callbacks, missing", [
    (FedFDP(**dp()), [RDPAccounting()], "NoisyLossReporting"),
    (FedFDP(**dp()), [NoisyLossReporting()], "RDPAccounting"),
    (FedAvg(**dp()), [], "RDPAccounting"),
    (FedFair(), [], "LossReporting"),
])
def test_refuses_to_start_without_the_callback_that_privatises_a_release(algorithm, callbacks, missing):
    with pytest.raises(ConfigError, match=missing):
        run_federation(algorithm, callbacks, rounds=1)


def test_fedfair_broadcast_loss_is_weighted_mean_of_reported_losses():
    class Capture(FederationCallback):
        def on_round_end(self, trainer, federation, context, updates, metrics):
            self.reported = [(u.reported_loss, u.num_examples) for u in updates]

    cap = Capture()
    fed, _ = run_federation(FedFair(fairness_weight=0.5, batch_size=32), [LossReporting(), cap], rounds=1)
    total = sum(n for _, n in cap.reported)
    assert fed.algorithm.broadcast_loss == pytest.approx(sum(l * n / total for l, n in cap.reported))


def test_fedfair_with_lambda_zero_equals_fedavg():
    fair, _ = run_federation(FedFair(fairness_weight=0.0, batch_size=32), [LossReporting()], rounds=2)
    avg, _ = run_federation(FedAvg(batch_size=32), [], rounds=2)
    torch.testing.assert_close(flat(fair.global_model), flat(avg.global_model))


def test_same_seed_same_model_different_seed_different_model():
    a, _ = run_federation(FedFDP(**dp()), [NoisyLossReporting(), RDPAccounting()], rounds=2, seed=3)
    b, _ = run_federation(FedFDP(**dp()), [NoisyLossReporting(), RDPAccounting()], rounds=2, seed=3)
    c, _ = run_federation(FedFDP(**dp()), [NoisyLossReporting(), RDPAccounting()], rounds=2, seed=4)
    assert torch.equal(flat(a.global_model), flat(b.global_model))
    assert not torch.equal(flat(a.global_model), flat(c.global_model))


def test_resume_from_checkpoint_is_bitwise_identical(tmp_path):
    """2 rounds, checkpoint, resume to 4 ≡ 4 rounds straight (model, accountant, loss bounds)."""
    def make(rounds, ckpt_dir=None):
        cbs = [NoisyLossReporting(), RDPAccounting()]
        fed = Federation(tiny_client(), FedFDP(**dp()), num_rounds=rounds, seed=1)
        extra = {}
        if ckpt_dir is not None:
            from lightning.pytorch.callbacks import ModelCheckpoint
            cbs.append(ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=1))
        trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                          max_epochs=-1, enable_checkpointing=ckpt_dir is not None, callbacks=cbs, **extra)
        return fed, trainer, cbs

    straight, t1, cbs1 = make(4)
    t1.fit(straight, datamodule=tiny_data())
    first, t2, _ = make(2, tmp_path)
    t2.fit(first, datamodule=tiny_data())
    resumed, t3, cbs3 = make(4, tmp_path)
    t3.fit(resumed, datamodule=tiny_data(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert t3.global_step == 4
    assert torch.equal(flat(straight.global_model), flat(resumed.global_model))
    assert cbs1[1].state_dict() == cbs3[1].state_dict()
    assert cbs1[0].state_dict() == cbs3[0].state_dict()
    assert straight.algorithm.broadcast_loss == resumed.algorithm.broadcast_loss


def test_evaluation_groups_give_per_client_models():
    """An algorithm whose evaluation groups all hold the global model reports the same metrics."""
    class Split(FedAvg):
        def evaluation_groups(self, global_params, num_clients):
            return [([c], global_params.clone()) for c in range(num_clients)]

    one, _ = run_federation(FedAvg(batch_size=32), [], rounds=1)
    split, _ = run_federation(Split(batch_size=32), [], rounds=1)
    assert torch.equal(flat(one.global_model), flat(split.global_model))
    a, b = one.last_evaluation, split.last_evaluation
    torch.testing.assert_close(a.client_accuracy, b.client_accuracy)
    torch.testing.assert_close(a.client_loss, b.client_loss)


def test_the_federation_owns_one_accountant_and_refuses_a_second():
    accountant = RDPAccounting()
    fed, _ = run_federation(FedAvg(**dp()), [NoisyLossReporting(), accountant], rounds=1)
    assert fed.accountant is accountant
    fed_plain, _ = run_federation(FedAvg(lr=0.1), [], rounds=1)
    assert fed_plain.accountant is None
    with pytest.raises(ConfigError, match="has 2 privacy accountants"):  # Lightning's own refusal is a traceback
        run_accountant_of([NoisyLossReporting(), RDPAccounting(), RDPAccounting(target_epsilon=1.0)])
