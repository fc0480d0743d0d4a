"""SIA / MIA audits and the fairness-in-privacy metrics (FinP spec §2-3) against constructed cases."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from callbacks import MembershipInferenceAudit, SourceInferenceAudit
from fedfdp.algorithms import FedAvg
from fedfdp.metrics import jain_index
from fedfdp.analysis.sia_metrics import (convergence_round, cov, eod, fairness_in_privacy, loss_cov, sia_accuracy,
                                        sia_loss_matrix, summarize_rounds)
from tests.helpers import run_federation


class Memoriser(nn.Module):
    """A "client model" that is confident (class 0) only on records whose feature is near its own id."""

    def __init__(self, client_id: float) -> None:
        super().__init__()
        self.client_id = client_id

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        score = 5.0 - 10.0 * (x[:, 0] - self.client_id) ** 2
        return torch.stack([score, torch.zeros_like(score)], dim=1)


def _fake_federation(num_clients: int, n: int = 8):
    data = [(torch.full((n, 1), float(c)) + 0.01 * torch.randn(n, 1), torch.zeros(n, dtype=torch.long))
            for c in range(num_clients)]
    dm = SimpleNamespace(num_clients=num_clients, client_train=lambda c: data[c], client_test=lambda c: data[c])
    return SimpleNamespace(datamodule=dm, seed=0, total_rounds=1)


def _run_attack(models: list[nn.Module], num_clients: int) -> dict[str, float]:
    fed = _fake_federation(num_clients)
    audit = SourceInferenceAudit(num_samples=5, write_json=False)
    context = SimpleNamespace(round=0)
    audit.on_round_start(None, fed, context, list(range(num_clients)))
    for cid, net in enumerate(models):
        client = SimpleNamespace(net=net, device=torch.device("cpu"),
                                 per_sample_loss=lambda o, t: F.cross_entropy(o, t, reduction="none"))
        audit.on_client_update(None, fed, client, SimpleNamespace(client_id=cid), None)
    metrics: dict[str, float] = {}
    audit.on_round_end(None, fed, context, [], metrics)
    return metrics


def test_sia_attributes_every_record_when_each_model_memorises_its_own_data():
    metrics = _run_attack([Memoriser(c) for c in range(4)], 4)
    assert metrics["sia_acc"] == 1.0 and metrics["sia_eod"] == 0.0 and metrics["sia_fi"] == 1.0
    assert metrics["sia_posterior"] > 0.9


def test_sia_is_at_chance_when_all_models_are_equal():
    metrics = _run_attack([Memoriser(0.5)] * 4, 4)
    assert metrics["sia_acc"] == pytest.approx(0.25)  # ties go to the first model: client 0 gets 1, others 0
    assert metrics["sia_posterior"] == pytest.approx(0.25) and metrics["sia_chance"] == 0.25


def test_metric_functions_on_hand_computed_examples():
    acc = [0.2, 0.4, 0.6]
    assert cov(acc) == pytest.approx(math.sqrt(((0.2 - 0.4) ** 2 + 0 + 0.2**2) / 3) / 0.4)
    assert jain_index(acc) == pytest.approx(1 / (1 + cov(acc) ** 2))  # FI = 1 / (1 + CoV^2)
    assert eod(acc) == pytest.approx(0.4)
    assert loss_cov(torch.tensor([[1.0, 3.0], [2.0, 2.0]])) == pytest.approx((0.5 + 0.0) / 2)
    # ell[k, j, n]: 2 models, 2 sources, 2 records; model 0 wins both of source 0's, one of source 1's
    ell = torch.tensor([[[0.1, 0.2], [0.3, 0.9]], [[0.5, 0.6], [0.4, 0.1]]])
    assert sia_accuracy(ell).tolist() == [1.0, 0.5]
    assert torch.allclose(sia_loss_matrix(ell), torch.tensor([[0.15, 0.55], [0.6, 0.25]], dtype=torch.float64))
    m = fairness_in_privacy(ell)
    assert m["sia_acc"] == 0.75 and m["sia_eod"] == 0.5 and m["sia_cov"] == pytest.approx(0.25 / 0.75)
    assert m["sia_loss_fi"] == pytest.approx(1 / (1 + m["sia_loss_cov"] ** 2))


def test_round_summary_max_is_of_client_means_and_convergence_rule():
    hist = [dict(sia_acc=a, sia_cov=c, sia_fi=0.9, sia_eod=0.1, sia_loss_cov=0.2, sia_loss_fi=0.96,
                 sia_posterior=0.3, sia_max_client=0.9) for a, c in ((0.2, 0.5), (0.4, 0.3))]
    table = summarize_rounds(hist)
    assert table["sia_table_mean"] == pytest.approx(30.0) and table["sia_table_max"] == pytest.approx(40.0)
    assert table["sia_cov_avg"] == pytest.approx(0.4)
    assert convergence_round([1, 2, 3, 4, 5], [0.5, 0.8, 0.7, 0.8, 0.8], last=3) == 4


def test_sia_and_mia_run_in_a_federation_and_report_every_metric():
    sia, mia = SourceInferenceAudit(num_samples=20, write_json=False), MembershipInferenceAudit(max_samples=50)
    fed, _ = run_federation(FedAvg(lr=0.5, local_epochs=3, batch_size=16), [sia, mia], rounds=2, eval_every=1)
    scalars = fed.last_evaluation.scalars
    assert 0.0 <= scalars["mia_auc"] <= 1.0 and 0.0 <= scalars["mia_advantage"] <= 1.0
    assert scalars["sia_rounds"] == 2 and 0 <= scalars["sia_table_mean"] <= 100
    assert len(sia.history) == 2 and len(sia.history[0]["accuracy"]) == 3
    assert sia.per_client == 20 and sia.targets[0].shape[0] == 60
