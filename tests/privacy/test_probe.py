"""The mechanism's probe of the model and loss it is handed (fedfdp.privacy.probe).

The class: "what the guarantee rests on is declared, not checked" for the model side: a layer or a
loss that mixes the samples of a batch, a buffer that keeps a statistic of the batch, an engine
whose per-sample gradients are wrong, a clip rule that does not bound a contribution. The issue
named one member (a per_sample_loss centring the logits by the batch mean); the others below were
not listed: a custom centring layer, BatchNorm without running statistics (no buffer to find), a
loss normalised by the batch maximum, a counter buffer, an engine that under-reports norms, an
engine that drops a record's gradient for one parameter, and a clip rule with factors above 1.
Each is refused by what the probe measures, not by its class.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from callbacks import RDPAccounting
from fedfdp import ClientModule
from fedfdp.algorithms import FedAvg
from fedfdp.errors import ConfigError
from fedfdp.privacy.clipping import flat_clip_factors
from fedfdp.grad_sample.engine import make_engine
from fedfdp.privacy.probe import probe_model
from tests.helpers import TinyConvNet, private, run_federation, tiny_data

X = torch.zeros(1, 1, 8, 8)
Y = torch.zeros(1, dtype=torch.long)


def ce(output, target):
    return F.cross_entropy(output, target, reduction="none")


def centred_by_batch_mean(output, target):
    return F.cross_entropy(output - output.mean(0, keepdim=True), target, reduction="none")


def scaled_by_batch_max(output, target):
    losses = F.cross_entropy(output, target, reduction="none")
    return losses / losses.detach().max()


class Centre(nn.Module):
    def forward(self, z):
        return z - z.mean(0, keepdim=True)


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, z):
        self.seen += z.shape[0]
        return z


def mlp(*middle: nn.Module) -> nn.Sequential:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 8), *middle, nn.ReLU(), nn.Linear(8, 4))


def probe(net, loss=ce, engine="auto", **kwargs):
    return probe_model(net, make_engine(net, engine, loss), loss, X, Y, 0.5, **kwargs)


@pytest.mark.parametrize("label, net, engine", [
    ("mlp", mlp(), "auto"),
    ("conv, ghost", TinyConvNet(), "ghost"),
    ("conv, vmap", TinyConvNet(), "vmap"),
    ("groupnorm", nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(144, 4)), "auto"),
    ("layernorm", mlp(nn.LayerNorm(8)), "auto"),
    ("dropout", mlp(nn.Dropout(0.5)), "ghost"),
    ("frozen layer", nn.Sequential(nn.Flatten(), nn.Linear(64, 8).requires_grad_(False), nn.Linear(8, 4)), "auto"),
])
def test_models_that_keep_the_guarantee_pass(label, net, engine):
    assert probe(net, engine=engine) == []


def test_probe_leaves_the_model_and_the_random_streams_as_they_were():
    net = mlp(nn.Dropout(0.5))
    net.eval()
    before = [p.detach().clone() for p in net.parameters()]
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    assert probe(net, engine="ghost") == []
    assert torch.equal(torch.rand(3), expected)
    assert not net.training and all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


@pytest.mark.parametrize("loss, label", [(centred_by_batch_mean, "batch mean"), (scaled_by_batch_max, "batch max")])
def test_a_loss_that_mixes_samples_is_refused_naming_the_loss(loss, label):
    problems = probe(nn.Sequential(nn.Flatten(), nn.Linear(64, 4)), loss)
    assert len(problems) == 1 and problems[0].startswith("per_sample_loss mixes the samples of a batch"), problems


@pytest.mark.parametrize("middle, culprit", [
    (Centre(), "2 (Centre)"),
    (nn.BatchNorm1d(8, track_running_stats=False), "2 (BatchNorm1d)"),
])
def test_a_layer_that_mixes_samples_is_refused_naming_the_layer(middle, culprit):
    problems = probe(mlp(middle), engine="vmap")
    assert problems == [problems[0]] and f"net: {culprit} mixes the samples of a batch" in problems[0], problems


@pytest.mark.parametrize("middle, culprit", [(Counter(), "2 (Counter)'s buffer 'seen'"),
                                             (nn.BatchNorm1d(8), "2 (BatchNorm1d)'s buffer 'running_mean'")])
def test_a_buffer_changed_by_a_training_forward_is_refused_and_restored(middle, culprit):
    net = mlp(middle)
    before = {name: b.clone() for name, b in net.named_buffers()}
    problems = probe(net, engine="vmap")
    assert len(problems) == 1 and culprit in problems[0] and "changes in a training forward" in problems[0]
    assert all(torch.equal(before[name], b) for name, b in net.named_buffers())


class _Engine:
    """An engine with one fault, around a correct one."""

    def __init__(self, net, fault: str) -> None:
        self.inner, self.fault = make_engine(net, "ghost", ce), fault

    def compute(self, x, y):
        result = self.inner.compute(x, y)
        if self.fault == "norms":
            result.norms = result.norms * 0.5
        elif self.fault == "gradient":
            inner = result._weighted_sum
            result._weighted_sum = lambda w: [g * 0 if k == 0 else g for k, g in enumerate(inner(w))]
        return result


@pytest.mark.parametrize("fault, says", [("norms", "reports a gradient norm"), ("gradient", "gradient of 1.weight")])
def test_an_engine_that_miscomputes_per_sample_gradients_is_refused(fault, says):
    net = mlp()
    problems = probe_model(net, _Engine(net, fault), ce, X, Y, 0.5)
    assert len(problems) == 1 and says in problems[0], problems


def test_a_clip_rule_that_does_not_bound_a_contribution_is_refused():
    net = mlp()
    problems = probe(net, clip_rule=lambda losses, norms: 3 * flat_clip_factors(norms, 0.5))
    assert len(problems) == 1 and "contribution of norm 3 C" in problems[0], problems


class CentredClient(ClientModule):
    """The issue's example: logits centred by the batch mean before the cross-entropy."""

    def per_sample_loss(self, output, target):
        return centred_by_batch_mean(output, target)


DP = dict(lr=0.5, sample_rate=0.2, max_grad_norm=1.0, noise_multiplier=1.0)


def test_a_private_run_with_a_mixing_loss_is_refused_before_any_release(tmp_path):
    from fedfdp import Federation
    from lightning.pytorch import Trainer
    from fedfdp.models import MLP

    ledger = tmp_path / "ledger.jsonl"
    fed = Federation(CentredClient(MLP(in_features=64, num_classes=4, hidden=16)), private(FedAvg, **DP), num_rounds=2)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, max_epochs=-1,
                      num_sanity_val_steps=0, limit_val_batches=0,
                      callbacks=[RDPAccounting(target_epsilon=5.0, ledger_path=str(ledger))])
    with pytest.raises(ConfigError, match=r"^CentredClient\.per_sample_loss mixes the samples of a batch"):
        trainer.fit(fed, datamodule=tiny_data())
    assert not ledger.exists() or ledger.read_text() == ""


def test_allow_non_private_runs_it_with_epsilon_infinite():
    from fedfdp.models import MLP

    net = MLP(in_features=64, num_classes=4, hidden=16)
    accountant = RDPAccounting(target_epsilon=5.0, allow_non_private=True)
    fed, _ = run_federation(private(FedAvg, **DP), [accountant], rounds=1, net=net)
    assert accountant.guarantee_holds  # the plain client keeps the guarantee
    accountant = RDPAccounting(target_epsilon=5.0, allow_non_private=True)
    from fedfdp import Federation
    from lightning.pytorch import Trainer

    fed = Federation(CentredClient(MLP(in_features=64, num_classes=4, hidden=16)), private(FedAvg, **DP), num_rounds=1)
    Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, max_epochs=-1, num_sanity_val_steps=0, limit_val_batches=0,
            callbacks=[accountant]).fit(fed, datamodule=tiny_data())
    assert not accountant.guarantee_holds


def test_a_plain_run_is_not_probed():
    _, trainer = run_federation(FedAvg(lr=0.1), [], rounds=1,
                                net=nn.Sequential(nn.Flatten(), Centre(), nn.Linear(64, 4)))
    assert trainer.global_step == 1
