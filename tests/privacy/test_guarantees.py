"""No release whose guarantee does not hold: σ = 0, unbounded clips, sample-mixing layers, NaN losses.

Table tests over every DP algorithm and every release it makes, property tests that one record
moves no other record's clipped contribution or loss, and the loss release's edge cases.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from callbacks import FederationCallback, NoisyGlobalLossReporting, NoisyLossReporting, RDPAccounting
from fedfdp.algorithms import (ALIDPFL, IFCA, KMCDPFL, QFFL, RCDPFL, ClusteredDPFL, Ditto, DPFedAvgAdaClip, DPFedAvgFairAgg,
                               DPFedAvgFineTune, DPFedAvgPriorCorrection, FedAvg, FedDyn, FedFDP, FedFDPFairAgg,
                               FedProx, FinP, LocalOnly, Scaffold)
from fedfdp.errors import ConfigError
from fedfdp.grad_sample.engine import GhostEngine, VmapEngine, per_sample_cross_entropy
from fedfdp.privacy import EpochDPSGD, SampleLevelDP
from fedfdp.privacy.release import clipped_loss_sum, noisy_loss_release
from fedfdp.privacy.validation import check_releases, sample_mixing_layers
from fedfdp.seeding import torch_generator
from tests.helpers import TinyConvNet, private, run_federation

DP = dict(lr=0.5, sample_rate=0.2, max_grad_norm=1.0, noise_multiplier=1.0)

#: every DP algorithm of the FedFDP family, each run with privacy=SampleLevelDP (the clustered family is
#: checked below)
DP_ALGORITHMS = [FedAvg, FedFDP, FedProx, Scaffold, FedDyn, QFFL, ALIDPFL, Ditto, FinP,
                 FedFDPFairAgg, DPFedAvgFairAgg, DPFedAvgAdaClip, LocalOnly, DPFedAvgPriorCorrection,
                 DPFedAvgFineTune]


def _callbacks(algorithm) -> list:
    import callbacks

    return [getattr(callbacks, path.removeprefix("callbacks."))() for path in algorithm.required_callbacks]


def test_the_table_lists_every_dp_algorithm():
    import fedfdp.algorithms as algorithms

    shipped = {getattr(algorithms, n) for n in algorithms.__all__}
    dp_family = {c for c in shipped if isinstance(c, type) and issubclass(c, FedAvg)
                 and "privacy" in inspect.signature(c.__init__).parameters}
    assert dp_family == set(DP_ALGORITHMS), "add new DP algorithms to DP_ALGORITHMS"


class _Releases(FederationCallback):
    """Records every DP event of every upload."""

    def __init__(self) -> None:
        self.events: list = []

    def on_before_aggregate(self, trainer, federation, updates):
        self.events += [event for u in updates for event in u.dp_events]


@pytest.mark.parametrize("cls", DP_ALGORITHMS, ids=lambda c: c.__name__)
def test_every_release_made_is_declared_and_checked(cls):
    """Each event an algorithm and its callbacks charge has the σ of a declared (checked) release."""
    algorithm = private(cls, **DP)
    recorder = _Releases()
    fed, _ = run_federation(algorithm, [*_callbacks(algorithm), recorder], rounds=2)
    declared = list(algorithm.dp_releases())
    for cb in fed.federation_callbacks():
        declared += cb.dp_releases(fed)
    assert recorder.events, "a DP algorithm released nothing"
    owners = [algorithm, *fed.federation_callbacks()]
    for release in declared:  # one meaning: a field named *noise_multiplier is the σ its release charges
        owner_name, leaf = release.noise_field.rsplit(".", 1)
        if not leaf.endswith("noise_multiplier"):
            continue
        if owner_name.split(".")[0] == "algorithm":  # algorithm, algorithm.privacy, ...
            owner = algorithm
            for part in owner_name.split(".")[1:]:
                owner = getattr(owner, part)
        else:
            owner = next(o for o in owners if owner_name in {c.__name__ for c in type(o).__mro__})
        assert release.noise_multiplier == getattr(owner, leaf), (release.name, release.noise_field)
    sigmas = {r.noise_multiplier for r in declared}
    for kind, event in recorder.events:
        assert event.noise_multiplier in sigmas, f"{kind} release with σ={event.noise_multiplier} is not declared"


@pytest.mark.parametrize("cls", DP_ALGORITHMS, ids=lambda c: c.__name__)
def test_zero_noise_on_the_model_update_is_refused_at_start(cls):
    algorithm = private(cls, **{**DP, "noise_multiplier": 0.0})
    with pytest.raises(ConfigError, match=r"algorithm\.privacy\.noise_multiplier=0\.0: the model update would be released "
                                          r"without noise"):
        run_federation(algorithm, [*_callbacks(algorithm)], rounds=1)


def test_fedfdp_with_sigma_zero_and_a_target_is_refused_even_with_the_noisy_loss_release():
    """The issue's case: the loss release kept the plan non-empty, so σ = 0 ran with ε = inf."""
    with pytest.raises(ConfigError, match=r"algorithm\.privacy\.noise_multiplier"):
        run_federation(private(FedFDP, **{**DP, "noise_multiplier": 0.0}),
                       [NoisyLossReporting(), RDPAccounting(target_epsilon=3.52)], rounds=None)


@pytest.mark.parametrize(("make", "field"), [
    (lambda: private(FedAvg, **{**DP, "max_grad_norm": math.inf}), r"algorithm\.privacy\.max_grad_norm must be finite"),
    (lambda: NoisyLossReporting(noise_multiplier=0.0), "NoisyLossReporting.noise_multiplier"),
    (lambda: NoisyLossReporting(loss_bound=math.inf), "NoisyLossReporting.loss_bound"),
    (lambda: NoisyGlobalLossReporting(noise_multiplier=0.0), "NoisyLossReporting.noise_multiplier"),
    (lambda: private(FinP, **DP, curvature_noise_multiplier=0.0), "algorithm.curvature_noise_multiplier"),
    (lambda: private(FinP, **DP, curvature_bound=math.inf), "algorithm.curvature_bound"),
    (lambda: RCDPFL(num_clusters=2, privacy=EpochDPSGD(noise_multiplier=0.0)),
     r"algorithm\.privacy\.noise_multiplier must be > 0"),
    (lambda: IFCA(num_clusters=2, privacy=EpochDPSGD(max_grad_norm=math.inf)),
     r"algorithm\.privacy\.max_grad_norm must be finite"),
    (lambda: RCDPFL(num_clusters=2), "RCDPFL is private: algorithm.privacy must be a fedfdp.privacy.EpochDPSGD, got null"),
    (lambda: KMCDPFL(num_clusters=2, privacy=SampleLevelDP()),
     "algorithm.privacy must be a fedfdp.privacy.EpochDPSGD, got SampleLevelDP"),
], ids=["dpfedavg-C-inf", "loss-sigma-0", "loss-bound-inf", "global-loss-sigma-0", "finp-curvature-sigma-0",
        "finp-curvature-bound-inf", "rcdpfl-sigma-0", "ifca-C-inf", "rcdpfl-no-mechanism", "kmcdpfl-other-mechanism"])
def test_releases_refused_when_configured(make, field):
    with pytest.raises(ConfigError, match=field):
        make()


def test_fedfdp_paper_raw_clipping_is_refused_unless_allowed():
    with pytest.raises(ConfigError, match="paper_raw, whose negative factors are unbounded"):
        run_federation(private(FedFDP, **DP, fair_clip_mode="paper_raw"), [NoisyLossReporting(), RDPAccounting()], rounds=1)
    acct = RDPAccounting(allow_non_private=True)
    run_federation(private(FedFDP, **DP, fair_clip_mode="paper_raw"), [NoisyLossReporting(), acct], rounds=1)
    assert acct.epsilon() == math.inf


@pytest.mark.parametrize("cls", [IFCA, RCDPFL], ids=lambda c: c.__name__)
def test_clustered_unnoised_selection_is_declared_without_a_guarantee(cls):
    loss = cls(num_clusters=2, privacy=EpochDPSGD(noise_multiplier=1.0), selection="loss")
    with pytest.raises(ConfigError, match="algorithm.selection"):
        check_releases(loss.dp_releases())
    check_releases(cls(num_clusters=2, privacy=EpochDPSGD(noise_multiplier=1.0), selection="private").dp_releases())
    assert issubclass(cls, ClusteredDPFL)


# ---- models whose samples are not independent -------------------------------------------------------
class _BNNet(nn.Module):
    def __init__(self, **bn_kwargs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 8)
        self.norm = nn.BatchNorm1d(8, **bn_kwargs)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x.flatten(1)))))


@pytest.mark.parametrize("bn_kwargs", [{}, {"track_running_stats": False}, {"affine": False}],
                         ids=["default", "no-running-stats", "no-affine"])
def test_batchnorm_is_refused_in_a_private_run(bn_kwargs):
    with pytest.raises(ConfigError, match=r"mix the samples of a batch \(norm: BatchNorm\).*replace_batchnorm"):
        run_federation(private(FedAvg, **DP), [RDPAccounting()], rounds=1, net=_BNNet(**bn_kwargs))


def test_batchnorm_is_replaced_by_groupnorm_when_the_user_opts_in():
    from fedfdp import ClientModule, Federation
    from tests.helpers import tiny_data
    from lightning.pytorch import Trainer

    client = ClientModule(_BNNet(), replace_batchnorm=True)
    assert sample_mixing_layers(client.net) == [] and isinstance(client.net.norm, nn.GroupNorm)
    fed = Federation(client, private(FedAvg, **DP), num_rounds=1)
    Trainer(accelerator="cpu", max_epochs=-1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[RDPAccounting()]).fit(fed, datamodule=tiny_data())


def test_batchnorm_is_fine_without_privacy():
    run_federation(FedAvg(lr=0.1, batch_size=16), [], rounds=1, net=_BNNet())


def _per_record_view(engine, loss_fn, x, y):
    """Each record's loss, gradient norm and clipped contribution s_j g_j (flattened)."""
    result = engine.compute(x, y)
    factors = torch.clamp(1.0 / result.norms.clamp(min=1e-12), max=1.0)  # flat clip at C = 1
    contributions = []
    for j in range(len(y)):
        onehot = torch.zeros(len(y), dtype=factors.dtype)
        onehot[j] = factors[j]
        contributions.append(torch.cat([g.flatten() for g in result.weighted_sum(onehot)]))
    with torch.no_grad():
        losses = loss_fn(engine.net(x), y)
    return result.losses, result.norms, torch.stack(contributions), losses


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(0, 5), engine_name=st.sampled_from(["ghost", "vmap"]))
def test_one_record_changes_no_other_records_contribution_or_loss(seed, k, engine_name):
    torch.manual_seed(seed)
    net = TinyConvNet()
    engine = GhostEngine(net) if engine_name == "ghost" else VmapEngine(net)
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 4, (6,))
    x2, y2 = x.clone(), y.clone()
    x2[k], y2[k] = 10 * torch.randn(1, 8, 8), (y[k] + 1) % 4
    before = _per_record_view(engine, per_sample_cross_entropy, x, y)
    after = _per_record_view(engine, per_sample_cross_entropy, x2, y2)
    others = [j for j in range(6) if j != k]
    for a, b in zip(before, after):
        torch.testing.assert_close(a[others], b[others], rtol=1e-5, atol=1e-6)
    assert torch.linalg.vector_norm(after[2][k]) <= 1.0 + 1e-5  # the changed record stays within C


def test_the_independence_check_catches_batchnorm():
    """The property above fails for a BatchNorm net in training mode: the test can fail."""
    torch.manual_seed(0)
    net = _BNNet()
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 4, (6,))
    x2 = x.clone()
    x2[0] = 10 * torch.randn(1, 8, 8)
    with torch.no_grad():
        moved = per_sample_cross_entropy(net(x), y)[1:] - per_sample_cross_entropy(net(x2), y)[1:]
    assert moved.abs().max() > 1e-3


# ---- the loss release's edge cases ------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(losses=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=0, max_size=20),
       bound=st.floats(1e-3, 10.0))
def test_clipped_loss_sum_is_finite_and_each_record_within_the_bound(losses, bound):
    t = torch.tensor(losses, dtype=torch.float32)
    total = float(clipped_loss_sum(t, bound))
    assert math.isfinite(total) and 0.0 <= total <= len(losses) * bound * (1 + 1e-6)
    for j in range(len(losses)):  # replacing one record moves the sum by at most C_l
        changed = t.clone()
        changed[j] = float("nan")
        assert abs(float(clipped_loss_sum(changed, bound)) - total) <= bound * (1 + 1e-5)
    released = noisy_loss_release(t, bound=bound, noise_multiplier=5.0, denominator=4.0,
                                  generator=torch_generator(0, "loss"))
    assert math.isfinite(released)


def test_nan_losses_count_as_the_bound_before_the_release():
    losses = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.5, -1.0])
    assert float(clipped_loss_sum(losses, 2.0)) == pytest.approx(2.0 + 2.0 + 0.0 + 0.5 + 0.0)


def test_the_adaptive_loss_bound_has_a_positive_floor_after_a_negative_release():
    from fedfdp.types import ClientUpdate

    cb = NoisyLossReporting(loss_bound=2.5, min_bound=1e-3)
    update = ClientUpdate(client_id=0, params=torch.zeros(1), num_examples=10, reported_loss=-3.0)
    cb.on_before_aggregate(None, None, [update])
    assert cb.bound(0) == 1e-3
    with pytest.raises(ConfigError, match="min_bound"):
        NoisyLossReporting(min_bound=0.0)
