"""DP-FedAvg with label-prior correction (DPFedAvgPriorCorrection, issue 23 item 7)."""

from __future__ import annotations

import json

import pytest
import torch

from callbacks import RDPAccounting
from fedfdp.algorithms import DPFedAvgPriorCorrection, FedAvg
from fedfdp.algorithms.prior import label_prior_offsets
from fedfdp.errors import ConfigError
from fedfdp.privacy import SampleLevelDP
from fedfdp.privacy.accounting import DPEvent, epsilon_of
from fedfdp.types import LABEL_HISTOGRAM_RELEASE
from tests.helpers import flat, run_federation, tiny_data

MECHANISM = dict(sample_rate=0.2, max_grad_norm=0.5, noise_multiplier=1.0)


def private() -> dict:
    """The options of every private algorithm here: ``lr`` 1 and the record-level mechanism."""
    return dict(lr=1.0, privacy=SampleLevelDP(**MECHANISM))


def _exact_counts(data) -> torch.Tensor:
    return torch.stack([torch.bincount(data.client_train(c)[1].long(), minlength=data.num_classes)
                        for c in range(data.num_clients)]).double()


def test_histograms_are_charged_once_per_client_and_noised_with_sigma_h():
    data = tiny_data(num_clients=4)
    accountant = RDPAccounting()
    fed, _ = run_federation(DPFedAvgPriorCorrection(prior_noise_multiplier=3.0, **private()), [accountant], rounds=2,
                            data=data)
    histogram = DPEvent(noise_multiplier=3.0, sample_rate=1.0)
    two_steps = DPEvent(noise_multiplier=1.0, sample_rate=0.2, steps=2)
    for cid in range(4):  # one histogram event first, then one DP-SGD step per round
        assert accountant.ledgers[cid].events == (histogram, two_steps)
    noise = fed.algorithm.noisy_counts - _exact_counts(data)
    assert noise.abs().max() > 0
    assert 1.0 < float(noise.std()) < 6.0  # 4 clients x 4 classes of N(0, 3^2)


def test_the_histogram_is_planned_into_the_budget():
    """Budget-limited: the one-off release is spent before planning, so the run trains the rounds
    that still fit and its epsilon (histogram included) stays within the target."""
    target = 8.0
    plain, _ = run_federation(FedAvg(**private()), [RDPAccounting(target_epsilon=target)], rounds=None)
    accountant = RDPAccounting(target_epsilon=target)
    fed, _ = run_federation(DPFedAvgPriorCorrection(prior_noise_multiplier=2.0, **private()), [accountant], rounds=None)
    assert fed.total_rounds < plain.total_rounds
    assert accountant.epsilon() <= target
    one_more = [DPEvent(noise_multiplier=2.0, sample_rate=1.0),
                DPEvent(noise_multiplier=1.0, sample_rate=0.2, steps=fed.total_rounds + 1)]
    assert epsilon_of(one_more, accountant.delta, accountant.orders) > target  # one more round would not fit


def test_training_is_dp_fedavgs_and_evaluation_adds_the_offsets():
    data = tiny_data(num_clients=4)
    dp, _ = run_federation(FedAvg(**private()), [RDPAccounting()], rounds=3, data=data)
    corrected, _ = run_federation(DPFedAvgPriorCorrection(prior_strength=1.0, **private()), [RDPAccounting()], rounds=3,
                                  data=data)
    assert torch.equal(flat(dp.global_model), flat(corrected.global_model))  # its own noise stream
    offsets = corrected.algorithm.evaluation_logit_offsets()
    assert offsets.shape == (4, data.num_classes)
    torch.testing.assert_close(offsets.double(), label_prior_offsets(corrected.algorithm.noisy_counts))
    x, y, cid, normalize = data.pooled_raw("test")
    with torch.no_grad():
        logits = corrected.released_model(normalize(x)) + offsets[cid]
    correct = (logits.argmax(1) == y).double()
    per_client = torch.zeros(4, dtype=torch.float64).index_add_(0, cid, correct) / torch.bincount(cid, minlength=4)
    torch.testing.assert_close(corrected.last_evaluation.client_accuracy.double(), per_client)
    zero, _ = run_federation(DPFedAvgPriorCorrection(prior_strength=0.0, **private()), [RDPAccounting()], rounds=3,
                             data=data)
    assert zero.algorithm.evaluation_logit_offsets() is None
    torch.testing.assert_close(zero.last_evaluation.client_accuracy, dp.last_evaluation.client_accuracy)


def test_offsets_favour_the_clients_own_labels():
    counts = torch.tensor([[90.0, 10.0, -3.0], [0.0, 50.0, 50.0]])
    offsets = label_prior_offsets(counts)
    assert offsets[0, 0] > 0 > offsets[0, 2]        # frequent here, rare in the pool
    assert offsets[1, 0] < offsets[1, 1]
    assert torch.isfinite(offsets).all()             # negative noisy counts are floored


def test_a_checkpointed_run_does_not_release_again(tmp_path):
    from tests.helpers import fit_resumable

    full = fit_resumable(lambda: DPFedAvgPriorCorrection(**private()), rounds=3)
    fit_resumable(lambda: DPFedAvgPriorCorrection(**private()), rounds=2, ckpt_dir=tmp_path)
    resumed = fit_resumable(lambda: DPFedAvgPriorCorrection(**private()), rounds=3,
                            ckpt_path=str(tmp_path / "last.ckpt"))
    torch.testing.assert_close(resumed.algorithm.noisy_counts, full.algorithm.noisy_counts)
    torch.testing.assert_close(flat(resumed.global_model), flat(full.global_model))


@pytest.mark.parametrize("kwargs, field", [(dict(prior_noise_multiplier=0.0), "prior_noise_multiplier"),
                                           (dict(prior_strength=-1.0), "prior_strength")])
def test_bad_settings_are_refused(kwargs, field):
    with pytest.raises(ConfigError, match=f"algorithm.{field}"):
        DPFedAvgPriorCorrection(**kwargs, **private())


def test_the_label_histogram_kind_is_recorded_in_the_ledger_file(tmp_path):
    path = tmp_path / "ledger.jsonl"
    run_federation(DPFedAvgPriorCorrection(**private()), [RDPAccounting(ledger_path=str(path))], rounds=1,
                   data=tiny_data(num_clients=3))
    kinds = [json.loads(line)["kind"] for line in path.read_text().splitlines()]
    assert kinds.count(LABEL_HISTOGRAM_RELEASE) == 3 and kinds[:3] == [LABEL_HISTOGRAM_RELEASE] * 3
