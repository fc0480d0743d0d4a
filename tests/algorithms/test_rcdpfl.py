"""RC-DPFL and its clustered baselines: clustering, two-stage accounting, aggregation, oracle = per-cluster FedAvg."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lightning.pytorch import Trainer

from callbacks import ClusterMetrics, RDPAccounting
from datamodules import ClusteredDigitsDataModule
from fedfdp import ClientModule, Federation
from fedfdp.aggregate import weighted_mean
from fedfdp.algorithms import IFCA, KMCDPFL, RCDPFL, FedAvg, LocalDPSGD, OracleCDPFL
from fedfdp.algorithms.clustering import auto_cluster_rounds, clustering_accuracy, fit_gmm, max_overlap, project_updates
from fedfdp.errors import ConfigError
from fedfdp.models import TinyCNN
from fedfdp.privacy import SampleLevelDP
from fedfdp.privacy.accounting import DPEvent, epsilon_of
from fedfdp.privacy.schedule import calibrate_noise_multiplier, dpsgd_round_event
from fedfdp.seeding import torch_generator
from fedfdp.types import ClientData, ClientUpdate, RoundContext
from tests.helpers import per_sample_grads, clustered

SIZES = (2, 3, 3)  # 8 clients in 3 clusters; cluster 0 is the minority
N_TRAIN = 60


def digits(**kwargs) -> ClusteredDigitsDataModule:
    args = dict(cluster_sizes=SIZES, train_per_client=N_TRAIN, test_per_client=20, sampling="overlap") | kwargs
    return ClusteredDigitsDataModule(**args)


def client() -> ClientModule:
    torch.manual_seed(0)
    return ClientModule(TinyCNN(channels=4))


def fit(algorithm, *, rounds: int = 2, data=None, callbacks=None, target=None, seed=0):
    fed = Federation(client(), algorithm, num_rounds=rounds, seed=seed, eval_every=rounds, eval_train_splits=False)
    # the seed's unnoised selection ('loss') has no guarantee: allowed for analysis only
    accountant = RDPAccounting(target_epsilon=target, delta=1e-4,
                               allow_non_private=getattr(algorithm, "selection", None) == "loss")
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, max_epochs=-1, num_sanity_val_steps=0, limit_val_batches=0,
                      callbacks=[accountant, *(callbacks or [])])
    trainer.fit(fed, datamodule=data if data is not None else digits())
    return fed, accountant


ALG = dict(num_clusters=3, lr=0.1, batch_size=10, max_grad_norm=1.0)


# ---- clustering (pure) --------------------------------------------------------------------------
def planted(gap: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    truth = np.repeat(np.arange(4), [3, 6, 6, 6])
    centres = gap * rng.standard_normal((4, 500))
    return centres[truth] + rng.standard_normal((len(truth), 500)), truth


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gmm_recovers_planted_clusters_of_well_separated_updates(seed):
    updates, truth = planted(gap=3.0, seed=seed)
    gmm = fit_gmm(project_updates(updates), 4, seed=seed)
    assert np.allclose(gmm.posteriors.sum(axis=1), 1.0)
    assert clustering_accuracy(gmm.posteriors.argmax(axis=1), truth) == 1.0
    overlap = max_overlap(gmm.means, gmm.radii)
    assert overlap < 0.05 and auto_cluster_rounds(overlap, 30) >= 14


def test_overlapping_updates_shorten_the_gmm_stage():
    updates, _ = planted(gap=0.02)
    gmm = fit_gmm(project_updates(updates), 4, seed=0)
    assert max_overlap(gmm.means, gmm.radii) > 0.1  # a GMM forced onto pure noise overlaps
    assert auto_cluster_rounds(max_overlap(gmm.means, gmm.radii), 30) < 14


def test_clustering_accuracy_is_permutation_invariant():
    truth = np.array([0, 0, 1, 1, 1, 2, 2])
    assert clustering_accuracy(np.array([2, 2, 0, 0, 0, 1, 1]), truth) == 1.0
    assert clustering_accuracy(np.array([2, 2, 0, 0, 1, 1, 1]), truth) == pytest.approx(6 / 7)
    assert clustering_accuracy(np.zeros(7, dtype=int), truth) == pytest.approx(3 / 7)


# ---- accounting ---------------------------------------------------------------------------------
def test_two_stage_calibration_meets_the_target_and_costs_more_noise():
    def two(z):
        return [dpsgd_round_event(noise_multiplier=z, dataset_size=400, batch_size=16, local_epochs=1, full_batch=True),
                dpsgd_round_event(noise_multiplier=z, dataset_size=400, batch_size=16, local_epochs=1,
                                  full_batch=False).repeated(29)]

    def one(z):
        return [dpsgd_round_event(noise_multiplier=z, dataset_size=400, batch_size=16, local_epochs=1,
                                  full_batch=False).repeated(30)]

    for eps in (5.0, 2.0):
        z2, z1 = (calibrate_noise_multiplier(s, target_epsilon=eps, delta=1e-4) for s in (two, one))
        assert epsilon_of(two(z2), 1e-4) <= eps < epsilon_of(two(z2 * 0.999), 1e-4)
        assert z2 > z1 * 1.1  # spec §2 / A19: the full-batch round is not free


def test_full_batch_round_charges_q_one_then_poisson_rounds():
    alg = clustered(RCDPFL, **ALG, noise_multiplier=2.0, selection="loss")
    fed, accountant = fit(alg, rounds=2)
    q = 10 / N_TRAIN
    for cid in range(sum(SIZES)):
        events = accountant.ledgers[cid].events
        assert events[0] == DPEvent(noise_multiplier=2.0, sample_rate=1.0, steps=1)
        assert events[1] == DPEvent(noise_multiplier=2.0, sample_rate=q, steps=N_TRAIN // 10)
    expected = epsilon_of([DPEvent(noise_multiplier=2.0, sample_rate=1.0),
                           DPEvent(noise_multiplier=2.0, sample_rate=q, steps=N_TRAIN // 10)], 1e-4)
    assert accountant.budgeted_epsilon() == pytest.approx(expected)  # the charged (noised) releases
    assert accountant.epsilon() == float("inf")  # the unnoised selection voids the guarantee


@pytest.mark.slow
def test_calibrated_run_spends_at_most_the_target_and_a_too_small_z_is_refused():
    alg = clustered(RCDPFL, **ALG, noise_multiplier=None, selection="private", cluster_rounds=1)
    fed, accountant = fit(alg, rounds=4, target=3.0)
    assert 2.9 < accountant.epsilon() <= 3.0  # the private selection of round 2 is charged too
    assert any(len(led.events) > 2 for led in accountant.ledgers.values())
    ifca = clustered(IFCA, **ALG, selection="private", selection_rounds=2)  # selections in rounds 0 and 1 only
    fed, accountant = fit(ifca, rounds=4, target=3.0)
    assert fed.total_rounds == 4 and 2.9 < accountant.epsilon() <= 3.0  # planning is not cut short
    with pytest.raises(ConfigError, match=r"algorithm\.privacy\.noise_multiplier=0\.5 spends epsilon=.* over the "
                                          r"whole schedule, over RDPAccounting\.target_epsilon=3\.0"):
        fit(clustered(RCDPFL, **ALG, noise_multiplier=0.5), rounds=4, target=3.0)


# ---- local update and aggregation ---------------------------------------------------------------
def test_full_batch_step_is_one_accumulated_pass_and_the_clipped_mean():
    dm = digits()
    dm.setup()
    x, y = dm.client_train(0)
    data = ClientData(client_id=0, x=x, y=y)

    def full_batch_step(chunk: int, z: float) -> tuple[torch.Tensor, torch.Tensor]:
        c = client()
        alg = clustered(RCDPFL, **ALG, noise_multiplier=1.0, physical_batch_size=chunk)
        alg.privacy.client_noise_multipliers = np.array([z])  # z_0 (set by setup in a run)
        batch = alg.private_batch(data, True, torch_generator(0, "t"))
        assert torch.equal(batch.x, x) and batch.denominator == len(y) and batch.physical_batch_size == chunk
        start = c.get_flat_params()
        c.training_step(batch)
        return start, c.get_flat_params()

    assert torch.allclose(full_batch_step(7, 0.5)[1], full_batch_step(10_000, 0.5)[1], atol=1e-6)
    start, end = full_batch_step(7, 0.0)  # noise-free: θ − η · mean_j clip(g_j, c)
    g = per_sample_grads(client(), x, y)
    clipped = g * torch.clamp(1.0 / g.norm(dim=1, keepdim=True), max=1.0)
    assert torch.allclose(end, start - 0.1 * clipped.mean(0), atol=1e-5)


def test_cluster_aggregation_weights_add_to_one_per_cluster():
    alg = clustered(OracleCDPFL, **ALG, noise_multiplier=1.0)
    alg.cluster_models = torch.zeros(3, 4)
    alg.assignment = np.zeros(5, dtype=np.int64)
    same = [ClientUpdate(client_id=i, params=torch.full((4,), 7.0), num_examples=n, extras={"cluster": torch.tensor(0)})
            for i, n in enumerate((1, 5, 13))]
    alg.aggregate(torch.zeros(4), same, RoundContext(round=1))
    assert torch.allclose(alg.cluster_models[0], torch.full((4,), 7.0))  # Σ_i w_i = 1
    mixed = [ClientUpdate(client_id=i, params=torch.full((4,), float(i)), num_examples=n,
                          extras={"cluster": torch.tensor(k)}) for i, (n, k) in enumerate(((1, 1), (3, 1), (2, 2)))]
    alg.aggregate(torch.zeros(4), mixed, RoundContext(round=2))
    assert torch.allclose(alg.cluster_models[1], torch.full((4,), 0.75))  # (1·0 + 3·1) / 4
    assert torch.allclose(alg.cluster_models[2], torch.full((4,), 2.0))
    assert torch.allclose(alg.cluster_models[0], torch.full((4,), 7.0))  # empty cluster keeps its model
    assert alg.assignment.tolist()[:3] == [1, 1, 2]


def test_oracle_equals_per_cluster_dpfedavg():
    dm = digits()
    fed, _ = fit(clustered(OracleCDPFL, **ALG, noise_multiplier=1.0), rounds=2, data=dm)
    mechanism = SampleLevelDP(sample_rate=10 / N_TRAIN, max_grad_norm=1.0, noise_multiplier=1.0,
                              local_steps=N_TRAIN // 10)
    reference = FedAvg(lr=0.1, privacy=mechanism)
    c = client()
    models = [c.get_flat_params() for _ in SIZES]
    for t in range(2):
        uploads: list[list[ClientUpdate]] = [[] for _ in SIZES]
        for cid, k in enumerate(dm.client_cluster):
            c.set_flat_params(models[k])
            x, y = dm.client_train(cid)
            uploads[k].append(reference.local_update(c, ClientData(cid, x, y), RoundContext(round=t),
                                                     torch_generator(0, "client", t, cid)))
        models = [weighted_mean([u.params for u in ups], [u.num_examples for u in ups]) for ups in uploads]
    for k in range(len(SIZES)):
        assert torch.allclose(fed.algorithm.cluster_models[k], models[k], atol=1e-6)


@pytest.mark.slow
def test_rcdpfl_separates_rotations_and_reports_cluster_metrics():
    # 8 clients: one seed's GMM accuracy moves in steps of 1/8 with the DP noise (0.625 to 1.0 over
    # seeds 0-5), so the claim is on the mean over three seeds
    accuracies = []
    for seed in (0, 1, 2):
        alg = clustered(RCDPFL, **ALG, target_epsilon=8.0, selection="private")
        fed, accountant = fit(alg, rounds=6, callbacks=[ClusterMetrics(reference_epochs=1)], target=8.0, seed=seed)
        accuracies.append(fed.last_evaluation.scalars["gmm_clustering_accuracy"])
    assert np.mean(accuracies) >= 0.75, accuracies
    scalars = fed.last_evaluation.scalars
    assert 2 <= alg.e_c <= 6 and alg.posteriors.shape == (8, 3)
    for key in ("acc_all", "acc_majority", "acc_minority", "acc_disparity", "f_acc", "f_loss", "clustering_accuracy"):
        assert np.isfinite(scalars[key])
    assert accountant.epsilon() <= 8.0
    state = alg.state_dict()
    clone = clustered(RCDPFL, **ALG, noise_multiplier=1.0)
    clone.load_state_dict(state)
    assert torch.equal(clone.cluster_models, alg.cluster_models) and clone.e_c == alg.e_c


@pytest.mark.slow
@pytest.mark.parametrize("cls", [IFCA, KMCDPFL, LocalDPSGD])
def test_baselines_run_and_keep_one_model_per_group(cls):
    kwargs = {"selection": "loss"} if cls is IFCA else {}
    fed, accountant = fit(clustered(cls, **ALG, noise_multiplier=1.0, **kwargs), rounds=2)
    alg = fed.algorithm
    groups = alg.evaluation_groups(torch.zeros(1), sum(SIZES))
    assert sorted(c for ids, _ in groups for c in ids) == list(range(sum(SIZES)))
    assert accountant.epsilon() > 0
    if cls is IFCA:
        assert not torch.allclose(alg.cluster_models[0], alg.cluster_models[1])  # distinct random inits
        assert accountant.guarantee_holds is False  # the seed's unnoised selection
    if cls is LocalDPSGD:
        assert len(groups) == sum(SIZES)


def test_oracle_needs_true_clusters_and_rcdpfl_a_round_count():
    with pytest.raises(ConfigError, match="num_clusters"):
        fit(clustered(OracleCDPFL, **(ALG | {"num_clusters": 2}), noise_multiplier=1.0), rounds=1)
    with pytest.raises(ConfigError, match="cluster_rounds"):
        clustered(RCDPFL, **ALG, cluster_rounds=0)
