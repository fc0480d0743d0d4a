"""The stacked round (fedfdp.stacked) equals the per-client round, and falls back when it must."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from callbacks import FederationCallback, NoisyLossReporting, RDPAccounting
from fedfdp import ClientModule, FedAvg, FedFDP
from fedfdp.grad_sample.engine import GhostEngine, VmapEngine
from fedfdp.stacked import StackedRound
from tests.helpers import TinyConvNet, flat, private, run_federation, tiny_data, clustered

DP = dict(lr=1.0, sample_rate=0.2, max_grad_norm=0.5, noise_multiplier=1.0)
# C large: the fair factor 1 + λ(ℓ_j − F̄) (not C/‖g_j‖) binds, and λ = 1 makes it vary (and go negative)
FAIR = dict(lr=0.5, sample_rate=0.2, max_grad_norm=100.0, noise_multiplier=1.0, fairness_weight=1.0)


class Uploads(FederationCallback):
    """Keeps every released upload (client, DP events, reported loss, diagnostics) in release order."""

    def __init__(self) -> None:
        self.released: list[tuple[int, int, list, float | None, dict[str, float]]] = []

    def on_client_release(self, trainer, federation, update):
        self.released.append((federation.current_round, update.client_id, list(update.dp_events),
                              update.reported_loss, dict(update.diagnostics)))


class CountStacked:
    """Counts stacked rounds (wraps StackedRound.run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rounds = 0
        run = StackedRound.run

        def counted(obj, *args, **kwargs):
            self.rounds += 1
            return run(obj, *args, **kwargs)

        monkeypatch.setattr(StackedRound, "run", counted)


def _net(kind: str) -> torch.nn.Module | None:
    torch.manual_seed(0)
    if kind == "resnet":  # GroupNorm layers: their grad samplers give the GN-ResNet the stacked path
        from fedfdp.models import ResNetGN
        return ResNetGN(depth=8, num_classes=4, in_channels=1, base_width=4, groups=2)
    return TinyConvNet() if kind == "conv" else None  # None: tests.helpers' MLP


def _run(algorithm_factory, net_kind: str, stacked: bool, rounds: int = 3, **kwargs):
    uploads, accountant = Uploads(), RDPAccounting()
    fed, _ = run_federation(algorithm_factory(), [NoisyLossReporting(), accountant, uploads], rounds=rounds,
                            net=_net(net_kind), stacked_round=stacked, **kwargs)
    return fed, uploads, accountant


def _assert_same_run(stacked_run, per_client_run) -> None:
    (fed_s, up_s, acc_s), (fed_p, up_p, acc_p) = stacked_run, per_client_run
    a, b = flat(fed_s.global_model), flat(fed_p.global_model)
    assert float((a - b).norm() / b.norm()) < 1e-6
    assert [(r, c, e) for r, c, e, _, _ in up_s.released] == [(r, c, e) for r, c, e, _, _ in up_p.released]
    assert acc_s.epsilon() == acc_p.epsilon()
    for (_, _, _, loss_s, diag_s), (_, _, _, loss_p, diag_p) in zip(up_s.released, up_p.released):
        assert math.isclose(loss_s, loss_p, rel_tol=1e-5, abs_tol=1e-6)
        assert diag_s["batch_size"] == diag_p["batch_size"]
        assert diag_s["negative_fraction"] == diag_p["negative_fraction"]
        assert math.isclose(diag_s["train_loss"], diag_p["train_loss"], rel_tol=1e-5, abs_tol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("net_kind", ["mlp", "conv", "resnet"])
@pytest.mark.parametrize("algorithm", ["dpfedavg", "fedfdp"])
def test_stacked_round_equals_per_client_round(monkeypatch, algorithm, net_kind):
    factory = (lambda: private(FedAvg, **DP)) if algorithm == "dpfedavg" else (lambda: private(FedFDP, **FAIR))
    counter = CountStacked(monkeypatch)
    stacked = _run(factory, net_kind, stacked=True)
    assert counter.rounds == 3
    per_client = _run(factory, net_kind, stacked=False)
    assert counter.rounds == 3  # stacked_round=False never stacks
    _assert_same_run(stacked, per_client)
    if algorithm == "fedfdp":  # the fair factor binds: some |s_j| < 1 although C/‖g_j‖ > 1
        assert any(diag["clipped_fraction"] > 0 for *_, diag in stacked[1].released)


def _run_plain(algorithm_factory, net_kind: str, stacked: bool, rounds: int):
    uploads, accountant = Uploads(), RDPAccounting()
    fed, _ = run_federation(algorithm_factory(), [accountant, uploads], rounds=rounds, net=_net(net_kind),
                            stacked_round=stacked)
    return fed, uploads, accountant


@pytest.mark.parametrize("net_kind", ["mlp", "conv", "resnet"])
@pytest.mark.parametrize(("algorithm", "steps"), [("local_dp", 1), ("finetune", 1), ("local_dp", 3), ("finetune", 3)])
def test_stacked_round_from_each_clients_own_model_equals_per_client_round(monkeypatch, algorithm, steps, net_kind):
    """Local-only DP-SGD and the fine-tuning phase start every client from its own model: one pass
    through the grouped network (a step of every client a pass), the same models, releases and ε
    as client by client: the step is written once (``local_step``) and kept as v_i on both."""
    from fedfdp.algorithms import DPFedAvgFineTune, LocalOnly

    monkeypatch.setattr(StackedRound, "lockstep_on_cpu", True)
    factory = ((lambda: private(LocalOnly, **DP, local_steps=steps)) if algorithm == "local_dp"
               else (lambda: private(DPFedAvgFineTune, finetune_fraction=0.5, finetune_lr=0.3, **DP, local_steps=steps)))
    counter = CountStacked(monkeypatch)
    stacked = _run_plain(factory, net_kind, stacked=True, rounds=4)
    assert counter.rounds == 4
    per_client = _run_plain(factory, net_kind, stacked=False, rounds=4)
    (fed_s, up_s, acc_s), (fed_p, up_p, acc_p) = stacked, per_client
    assert [(r, c, e) for r, c, e, _, _ in up_s.released] == [(r, c, e) for r, c, e, _, _ in up_p.released]
    assert acc_s.epsilon() == acc_p.epsilon()
    own_s, own_p = fed_s.algorithm.client_state, fed_p.algorithm.client_state
    name = "local" if algorithm == "local_dp" else "finetuned"
    for cid in range(3):
        a, b = own_s.get(cid, name), own_p.get(cid, name)
        assert a is not None and float((a - b).norm() / b.norm()) < 1e-5
    for (_, _, _, _, diag_s), (_, _, _, _, diag_p) in zip(up_s.released, up_p.released):
        assert diag_s["batch_size"] == diag_p["batch_size"]
        assert math.isclose(diag_s["train_loss"], diag_p["train_loss"], rel_tol=1e-5, abs_tol=1e-6)


@pytest.mark.parametrize("net_kind", ["mlp", "conv"])
def test_stacked_round_with_empty_client_batches(monkeypatch, net_kind):
    """A client whose Poisson batch is empty still gets its noise (and a model that moved)."""
    _allow_tiny_batches(monkeypatch)
    factory = lambda: private(FedFDP, **{**FAIR, "sample_rate": 0.01})  # noqa: E731  ~100 samples per client
    counter = CountStacked(monkeypatch)
    stacked = _run(factory, net_kind, stacked=True)
    per_client = _run(factory, net_kind, stacked=False)
    assert counter.rounds == 3
    sizes = [diag["batch_size"] for *_, diag in stacked[1].released]
    assert 0 in sizes and any(s > 0 for s in sizes)
    _assert_same_run(stacked, per_client)


@pytest.mark.parametrize(("max_batch", "passes_per_round"), [(40, 2), (1, 3)])
def test_stacked_round_in_several_engine_passes(monkeypatch, max_batch, passes_per_round):
    """Groups of whole clients (expected batch ~20 each): the same run as client by client."""
    calls = []
    compute = GhostEngine.compute
    monkeypatch.setattr(GhostEngine, "compute", lambda engine, x, y: calls.append(len(y)) or compute(engine, x, y))
    factory = lambda: private(FedFDP, **FAIR)  # noqa: E731
    stacked = _run(factory, "conv", stacked=True, stacked_max_batch=max_batch)
    assert len(calls) == 1 + 3 * passes_per_round  # the mechanism's probe of the model at start, then the rounds
    per_client = _run(factory, "conv", stacked=False)
    _assert_same_run(stacked, per_client)


def _allow_tiny_batches(monkeypatch):
    """Empty batches at will: the start check that refuses an expected batch q*|D_i| below one record
    (fedfdp.plan) is off, so that the engines' empty-batch path runs every round."""
    monkeypatch.setattr("fedfdp.federation.check_expected_batches", lambda federation: None)


def test_all_batches_empty(monkeypatch):
    _allow_tiny_batches(monkeypatch)
    factory = lambda: private(FedAvg, **{**DP, "sample_rate": 1e-6})  # noqa: E731
    counter = CountStacked(monkeypatch)
    stacked = _run(factory, "conv", stacked=True, rounds=2)
    per_client = _run(factory, "conv", stacked=False, rounds=2)
    assert counter.rounds == 2
    assert all(diag["batch_size"] == 0 for *_, diag in stacked[1].released)
    _assert_same_run(stacked, per_client)


class LoggingClient(ClientModule):
    """A user's client that overrides the private step (and must therefore run client by client)."""

    calls = 0

    def _private_step(self, batch):
        type(self).calls += 1
        return super()._private_step(batch)


class CountingDPFedAvg(FedAvg):
    """A user's algorithm with its own local update."""

    calls = 0

    def local_update(self, client, data, context, generator):
        type(self).calls += 1
        return super().local_update(client, data, context, generator)


def _fallback_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "stacked round off" in r.getMessage()]


def test_client_override_runs_per_client_and_logs_once(monkeypatch, caplog):
    counter = CountStacked(monkeypatch)
    torch.manual_seed(0)
    client = LoggingClient(TinyConvNet())
    caplog.set_level(logging.INFO, logger="fedfdp.stacked")
    from lightning.pytorch import Trainer

    from fedfdp import Federation

    fed = Federation(client, private(FedAvg, **DP), num_rounds=3, seed=0)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, max_epochs=-1,
                      callbacks=[RDPAccounting()])
    trainer.fit(fed, datamodule=tiny_data())
    assert counter.rounds == 0
    assert LoggingClient.calls == 3 * 3  # 3 rounds x 3 clients, each through the override
    messages = _fallback_messages(caplog)
    assert len(messages) == 1 and "LoggingClient overrides ClientModule._private_step" in messages[0]


def test_algorithm_override_runs_per_client_and_logs_once(monkeypatch, caplog):
    counter = CountStacked(monkeypatch)
    caplog.set_level(logging.INFO, logger="fedfdp.stacked")
    CountingDPFedAvg.calls = 0
    run_federation(private(CountingDPFedAvg, **DP), [RDPAccounting()], rounds=3)
    assert counter.rounds == 0 and CountingDPFedAvg.calls == 9
    messages = _fallback_messages(caplog)
    assert len(messages) == 1 and "CountingDPFedAvg.stackable_step returned None" in messages[0]


@pytest.mark.parametrize("net_kind", ["mlp", "conv"])
@pytest.mark.parametrize("algorithm", ["dpfedavg", "fedfdp"])
def test_several_local_steps_in_lockstep_equal_the_per_client_round(monkeypatch, algorithm, net_kind):
    """K = 3 local steps: step k of every client in one pass (each client at its own model after
    step k - 1), each client's own batches, clip rule, noise and release: the same global model,
    releases, diagnostics and ε as client by client."""
    monkeypatch.setattr(StackedRound, "lockstep_on_cpu", True)
    factory = ((lambda: private(FedAvg, **DP, local_steps=3)) if algorithm == "dpfedavg"
               else (lambda: private(FedFDP, **FAIR, local_steps=3)))
    counter = CountStacked(monkeypatch)
    lockstep = _run(factory, net_kind, stacked=True)
    assert counter.rounds == 3
    per_client = _run(factory, net_kind, stacked=False)
    _assert_same_run(lockstep, per_client)
    assert all(e.steps == 3 for *_, events, _, _ in lockstep[1].released for name, e in events if name == "model")


def test_several_local_steps_run_per_client_on_the_cpu_by_default(monkeypatch, caplog):
    """On the CPU client by client is faster for several steps: lockstep is off there unless asked."""
    counter = CountStacked(monkeypatch)
    caplog.set_level(logging.INFO, logger="fedfdp.stacked")
    run_federation(private(FedAvg, **DP, local_steps=2), [RDPAccounting()], rounds=2)
    assert counter.rounds == 0
    messages = _fallback_messages(caplog)
    assert len(messages) == 1 and "2 local steps on the CPU" in messages[0]


def test_lockstep_in_several_engine_passes_equals_the_per_client_round(monkeypatch):
    """Lockstep steps within groups of clients (several engine passes a step) change nothing."""
    monkeypatch.setattr(StackedRound, "lockstep_on_cpu", True)
    factory = lambda: private(FedAvg, **DP, local_steps=2)  # noqa: E731
    counter = CountStacked(monkeypatch)
    grouped = _run(factory, "mlp", stacked=True, stacked_max_batch=40)
    assert counter.rounds == 3
    _assert_same_run(grouped, _run(factory, "mlp", stacked=False))


def test_several_local_steps_with_a_stateful_optimizer_run_per_client(monkeypatch, caplog):
    """Adam carries its moments from a client's step to the next: such a round runs client by client."""
    from lightning.pytorch import Trainer

    from fedfdp import Federation

    monkeypatch.setattr(StackedRound, "lockstep_on_cpu", True)
    counter = CountStacked(monkeypatch)
    caplog.set_level(logging.INFO, logger="fedfdp.stacked")
    torch.manual_seed(0)
    client = ClientModule(TinyConvNet(), local_optimizer=lambda params: torch.optim.Adam(params))
    fed = Federation(client, private(FedAvg, **DP, local_steps=2), num_rounds=2, seed=0)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, max_epochs=-1,
                      callbacks=[RDPAccounting()])
    trainer.fit(fed, datamodule=tiny_data())
    assert counter.rounds == 0
    messages = _fallback_messages(caplog)
    assert len(messages) == 1 and "2 local steps with a stateful local optimizer (Adam)" in messages[0]


def test_vmap_engine_runs_per_client(monkeypatch):
    counter = CountStacked(monkeypatch)
    torch.manual_seed(0)
    from lightning.pytorch import Trainer

    from fedfdp import Federation

    fed = Federation(ClientModule(TinyConvNet(), per_sample="vmap"), private(FedAvg, **DP), num_rounds=1, seed=0)
    Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, max_epochs=-1, callbacks=[RDPAccounting()]).fit(fed, datamodule=tiny_data())
    assert counter.rounds == 0


@pytest.mark.parametrize("conv_method", ["materialize", "input_gram"])
@pytest.mark.parametrize("engine_kind", ["ghost", "vmap"])
def test_segment_weighted_sums_equal_per_segment_sums(engine_kind, conv_method):
    if engine_kind == "vmap" and conv_method == "input_gram":
        pytest.skip("the vmap engine has no conv method")
    torch.manual_seed(0)
    net = TinyConvNet()
    engine = GhostEngine(net, conv_method=conv_method) if engine_kind == "ghost" else VmapEngine(net)
    x, y = torch.randn(23, 1, 8, 8, dtype=torch.float64), torch.randint(0, 4, (23,))
    net.double()
    offsets = [0, 5, 5, 17, 23]  # an empty segment in the middle
    weights = torch.rand(23, dtype=torch.float64) - 0.3
    segments = engine.compute(x, y).segment_weighted_sums(weights, offsets)
    assert len(segments) == 4
    for (lo, hi), got in zip(zip(offsets, offsets[1:]), segments):
        expected = (engine.compute(x[lo:hi], y[lo:hi]).weighted_sum(weights[lo:hi]) if hi > lo
                    else [torch.zeros_like(p) for p in net.parameters()])
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_segment_offsets_are_checked():
    torch.manual_seed(0)
    engine = GhostEngine(TinyConvNet())
    result = engine.compute(torch.randn(4, 1, 8, 8), torch.randint(0, 4, (4,)))
    with pytest.raises(ValueError, match="offsets"):
        result.segment_weighted_sums(torch.ones(4), [0, 3, 2, 4])
    with pytest.raises(ValueError, match="offsets"):
        result.segment_weighted_sums(torch.ones(4), [0, 5])


def _fit_clustered(algorithm, stacked: bool, rounds: int = 4):
    from lightning.pytorch import Trainer

    from fedfdp import Federation

    uploads, accountant = Uploads(), RDPAccounting(delta=1e-4)
    fed = Federation(ClientModule(_net("conv")), algorithm, num_rounds=rounds, seed=0, eval_every=rounds,
                     eval_train_splits=False, stacked_round=stacked)
    Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, max_epochs=-1, num_sanity_val_steps=0, limit_val_batches=0,
            callbacks=[accountant, uploads]).fit(fed, datamodule=tiny_data(num_clients=5, num_samples=400))
    return fed, uploads, accountant


CLUSTERED = dict(num_clusters=2, lr=0.2, max_grad_norm=1.0, noise_multiplier=1.0, selection_epsilon=1.0)
NO_SELECTION = {k: v for k, v in CLUSTERED.items() if k != "selection_epsilon"}


@pytest.mark.parametrize(("name", "batch_size"), [("rcdpfl", 8), ("ifca", 8), ("kmcdpfl", 8), ("local", 8),
                                                  ("ifca", 30)])
def test_clustered_local_epochs_in_lockstep_equal_the_per_client_round(monkeypatch, name, batch_size):
    """The clustered family (RC-DPFL, IFCA, KM-CDPFL, local DP-SGD): each client's private cluster
    selection first (its evaluations and charged draw), then its own ⌊N_i/b⌋ steps (clients of
    different sizes leave the lockstep passes at different steps; with b = 30 the 21-record client
    samples at q = min(1, b/N_i) = 1), in lockstep: the same cluster models, assignments, releases, diagnostics and ε as client
    by client (RC-DPFL's full-batch first round runs per client)."""
    from fedfdp.algorithms import IFCA, KMCDPFL, RCDPFL, LocalDPSGD
    from fedfdp.privacy.schedule import steps_per_epoch

    make = {"rcdpfl": lambda: clustered(RCDPFL, **CLUSTERED, batch_size=batch_size, selection="private", cluster_rounds=1),
            "ifca": lambda: clustered(IFCA, **CLUSTERED, batch_size=batch_size, selection="private"),
            "kmcdpfl": lambda: clustered(KMCDPFL, **NO_SELECTION, batch_size=batch_size),
            "local": lambda: clustered(LocalDPSGD, **NO_SELECTION, batch_size=batch_size)}[name]
    monkeypatch.setattr(StackedRound, "lockstep_on_cpu", True)
    counter = CountStacked(monkeypatch)
    fed_s, up_s, acc_s = _fit_clustered(make(), stacked=True)
    assert counter.rounds == (3 if name == "rcdpfl" else 4)
    fed_p, up_p, acc_p = _fit_clustered(make(), stacked=False)
    assert counter.rounds == (3 if name == "rcdpfl" else 4)
    steps = {steps_per_epoch(int(n), batch_size) for n in fed_s.datamodule.train_sizes}
    assert len(steps) > 1  # the clients' step counts differ
    assert [(r, c, e) for r, c, e, _, _ in up_s.released] == [(r, c, e) for r, c, e, _, _ in up_p.released]
    assert acc_s.epsilon() == acc_p.epsilon()
    alg_s, alg_p = fed_s.algorithm, fed_p.algorithm
    assert alg_s.assignment.tolist() == alg_p.assignment.tolist()
    assert torch.allclose(alg_s.cluster_models, alg_p.cluster_models, rtol=1e-5, atol=1e-6)
    for (*_, diag_s), (*_, diag_p) in zip(up_s.released, up_p.released):
        assert math.isclose(diag_s["train_loss"], diag_p["train_loss"], rel_tol=1e-5, abs_tol=1e-6)
