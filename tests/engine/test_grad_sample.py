"""Per-sample engines against a microbatch loop, and the end-to-end clip invariant on real gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

from fedfdp.models import FedAvgCNN
from fedfdp.privacy.clipping import FairClip
from fedfdp.grad_sample.engine import GhostEngine, VmapEngine, ghost_unsupported_reason, make_engine, \
    per_sample_cross_entropy
from tests.helpers import TinyConvNet, assert_matches, microbatch_grads


@pytest.mark.parametrize("engine_cls", [GhostEngine, VmapEngine])
@pytest.mark.parametrize("make_net", [TinyConvNet, lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.Tanh(),
                                                                           nn.Linear(8, 4))])
def test_engine_matches_microbatch_loop(engine_cls, make_net):
    torch.manual_seed(0)
    net = make_net()
    x, y = torch.randn(7, 1, 8, 8), torch.randint(0, 4, (7,))
    ref = microbatch_grads(net, x, y)
    result = engine_cls(net).compute(x, y)
    torch.testing.assert_close(result.losses, per_sample_cross_entropy(net(x), y).detach())
    assert_matches(result, ref, torch.randn(7), rtol=1e-5)


def test_ghost_engine_on_fedavg_cnn_matches_microbatch():
    torch.manual_seed(1)
    net = FedAvgCNN()
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    ref = microbatch_grads(net, x, y)
    assert_matches(GhostEngine(net).compute(x, y), ref, torch.rand(4))


@settings(max_examples=40, deadline=None)
@given(c_in=st.integers(1, 3), c_out=st.integers(1, 4), kh=st.integers(1, 3), kw=st.integers(1, 3),
       stride=st.tuples(st.integers(1, 2), st.integers(1, 2)), dilation=st.tuples(st.integers(1, 2), st.integers(1, 2)),
       padding=st.tuples(st.integers(0, 2), st.integers(0, 2)), bias=st.booleans(), frozen_weight=st.booleans(),
       height=st.integers(5, 9), width=st.integers(5, 9), batch=st.integers(1, 5), seed=st.integers(0, 10_000),
       method=st.sampled_from(["materialize", "input_gram", "auto"]))
def test_conv_methods_match_microbatch_for_any_geometry(c_in, c_out, kh, kw, stride, dilation, padding, bias,
                                                        frozen_weight, height, width, batch, seed, method):
    """Every Conv2d norm method is exact (vs one backward per sample) for any kernel, stride, dilation, padding."""
    torch.manual_seed(seed)
    conv = nn.Conv2d(c_in, c_out, (kh, kw), stride=stride, dilation=dilation, padding=padding, bias=bias)
    out_h = (height + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    out_w = (width + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    if out_h < 1 or out_w < 1:
        return
    conv.weight.requires_grad_(not frozen_weight)
    net = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(c_out * out_h * out_w, 3))
    x, y = torch.randn(batch, c_in, height, width), torch.randint(0, 3, (batch,))
    trainable = [p for p in net.parameters() if p.requires_grad]
    rows = []
    for j in range(batch):
        grads = torch.autograd.grad(per_sample_cross_entropy(net(x[j:j + 1]), y[j:j + 1]).sum(), trainable)
        rows.append(torch.cat([g.flatten() for g in grads]))
    ref = torch.stack(rows)
    assert_matches(GhostEngine(net, conv_method=method).compute(x, y), ref, torch.randn(batch), atol=1e-5)


@pytest.mark.parametrize("method", ["materialize", "input_gram"])
def test_conv_methods_exact_on_fedavg_cnn_across_chunks(method, monkeypatch):
    """Batches split into several cache-sized chunks give the same norms and sums as one pass."""
    import fedfdp.grad_sample.conv as conv_grads

    torch.manual_seed(2)
    net = FedAvgCNN()
    x, y = torch.randn(5, 1, 28, 28), torch.randint(0, 10, (5,))
    ref = microbatch_grads(net, x, y)
    monkeypatch.setattr(conv_grads, "_CHUNK_BYTES", 1)  # one sample per chunk
    assert_matches(GhostEngine(net, conv_method=method).compute(x, y), ref, torch.rand(5))


def test_reused_buffers_give_exact_results_and_stale_results_raise():
    """Per-sample buffers are reused across batches of any size; an old result cannot be misused."""
    torch.manual_seed(3)
    net = FedAvgCNN()
    engine = GhostEngine(net, conv_method="materialize")
    for batch in (6, 3, 6):
        x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
        ref = microbatch_grads(net, x, y)
        result, weights = engine.compute(x, y), torch.rand(batch)
        assert_matches(result, ref, weights)
    engine.compute(x, y)
    with pytest.raises(RuntimeError, match="after a later compute"):
        result.weighted_sum(weights)


def test_empty_batch_gives_zero_sum():
    net = TinyConvNet()
    result = GhostEngine(net).compute(torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long))
    assert result.norms.numel() == 0
    assert all(torch.count_nonzero(g) == 0 for g in result.weighted_sum(torch.zeros(0)))


def test_auto_falls_back_to_vmap_for_unsupported_layers():
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.PReLU(), nn.Linear(8, 4))
    assert "PReLU" in ghost_unsupported_reason(net) and "no grad sampler" in ghost_unsupported_reason(net)
    assert isinstance(make_engine(net, "auto"), VmapEngine)
    with pytest.raises(ValueError, match="GhostEngine cannot handle"):
        GhostEngine(net)
    bn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    assert "BatchNorm" in ghost_unsupported_reason(bn)


@settings(max_examples=25, deadline=None)
@given(lam=st.floats(min_value=0.0, max_value=100.0), broadcast=st.floats(min_value=-50.0, max_value=50.0),
       clip=st.floats(min_value=1e-3, max_value=10.0), scale=st.floats(min_value=0.01, max_value=100.0),
       seed=st.integers(min_value=0, max_value=10_000), mode=st.sampled_from(["symmetric", "code", "nonneg"]))
def test_fair_clipped_real_gradients_bounded_by_c(lam, broadcast, clip, scale, seed, mode):
    """For any λ, broadcast loss, C and input scale the clipped per-sample gradients have norm ≤ C."""
    torch.manual_seed(seed)
    net = TinyConvNet()
    x, y = scale * torch.randn(6, 1, 8, 8), torch.randint(0, 4, (6,))
    result = GhostEngine(net).compute(x, y)
    factors = FairClip(clip, fairness_weight=lam, broadcast_loss=broadcast, mode=mode)(result.losses, result.norms)
    contributions = factors[:, None] * microbatch_grads(net, x, y)
    assert (contributions.norm(dim=1) <= clip * (1 + 1e-4)).all()


# ---- the per-layer registry: every built-in grad sampler against one backward per sample ----

class _Tokens(nn.Module):
    def __init__(self, vocab: int, dim: int, padding_idx, norm_shape: int, ln_bias: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.norm = nn.LayerNorm(dim, bias=ln_bias) if norm_shape == 1 else nn.LayerNorm((4, dim), bias=ln_bias)
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.embed(x))).mean(1))


@settings(max_examples=30, deadline=None)
# dim >= 2: a LayerNorm over one value outputs its bias alone, and the embedding's true gradient, 0, comes out
# of the normalisation's backward as float noise (1e-5) that differs between a batch and one sample
@given(vocab=st.integers(2, 6), dim=st.integers(2, 5), padding=st.sampled_from([None, 0, 1]),
       norm_shape=st.sampled_from([1, 2]), ln_bias=st.booleans(), batch=st.integers(1, 5), seed=st.integers(0, 9999))
def test_embedding_and_layer_norm_samplers_match_microbatch(vocab, dim, padding, norm_shape, ln_bias, batch, seed):
    """Embedding (repeated tokens, a padding row) and LayerNorm (1- and 2-dim shapes, with and without bias)."""
    torch.manual_seed(seed)
    padding = None if padding is None else min(padding, vocab - 1)
    net = _Tokens(vocab, dim, padding, norm_shape, ln_bias)
    x = torch.randint(0, vocab, (batch, 4))  # 4 positions of a small vocabulary: tokens repeat
    y = torch.randint(0, 3, (batch,))
    assert ghost_unsupported_reason(net) is None
    assert_matches(GhostEngine(net).compute(x, y), microbatch_grads(net, x, y), torch.randn(batch), atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(groups=st.sampled_from([1, 2, 4]), spatial=st.sampled_from([(), (3,), (3, 2)]), affine=st.booleans(),
       frozen_bias=st.booleans(), batch=st.integers(1, 5), seed=st.integers(0, 9999))
def test_group_norm_sampler_matches_microbatch(groups, spatial, affine, frozen_bias, batch, seed):
    """GroupNorm on (B, C), (B, C, L) and (B, C, H, W), any group count, a frozen bias."""
    assume(spatial or groups < 4)  # torch refuses a group of one value
    torch.manual_seed(seed)
    norm = nn.GroupNorm(groups, 4, affine=affine)
    if affine:
        nn.init.normal_(norm.weight)
        nn.init.normal_(norm.bias)
        norm.bias.requires_grad_(not frozen_bias)
    width = 4 * (1 if not spatial else int(torch.tensor(spatial).prod()))
    net = nn.Sequential(nn.Linear(3, width), nn.Unflatten(1, (4, *spatial)), norm, nn.Tanh(), nn.Flatten(),
                        nn.Linear(width, 3))
    x, y = torch.randn(batch, 3), torch.randint(0, 3, (batch,))
    trainable = [p for p in net.parameters() if p.requires_grad]
    rows = [torch.cat([g.flatten() for g in torch.autograd.grad(
        per_sample_cross_entropy(net(x[j:j + 1]), y[j:j + 1]).sum(), trainable)]) for j in range(batch)]
    assert_matches(GhostEngine(net).compute(x, y), torch.stack(rows), torch.randn(batch), atol=1e-5)


def test_groupnorm_resnet_gets_the_ghost_engine_and_exact_gradients():
    from fedfdp.models import ResNetGN

    torch.manual_seed(3)
    net = ResNetGN(depth=8, in_channels=3, base_width=4, groups=2)
    assert ghost_unsupported_reason(net) is None and isinstance(make_engine(net), GhostEngine)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    assert_matches(GhostEngine(net).compute(x, y), microbatch_grads(net, x, y), torch.rand(4), atol=1e-5)


def test_a_new_layer_type_is_one_registration():
    """A user's layer (a per-channel scale) gets the ghost engine by registering its grad sampler."""
    from fedfdp.grad_sample import MaterializedFactors, register_grad_sampler, registered_layers
    from fedfdp.grad_sample import registry

    class Scale(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.gamma = nn.Parameter(torch.randn(dim))

        def forward(self, a):
            return a * self.gamma

    net = nn.Sequential(nn.Linear(5, 4), Scale(4), nn.Tanh(), nn.Linear(4, 3))
    assert "Scale" in ghost_unsupported_reason(net)
    try:
        @register_grad_sampler(Scale)
        def scale_factors(layer, a, b, ctx):  # ∇γ ℓ_j = a_j ⊙ b_j
            return MaterializedFactors(layer, {id(layer.gamma): a * b})

        assert "Scale" in registered_layers() and ghost_unsupported_reason(net) is None
        x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
        assert_matches(GhostEngine(net).compute(x, y), microbatch_grads(net, x, y), torch.randn(6))
    finally:
        registry._SAMPLERS.pop(Scale, None)


def test_subclasses_keep_the_sampler_only_with_the_base_forward():
    class Renamed(nn.Linear):
        pass

    class OwnForward(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    assert ghost_unsupported_reason(nn.Sequential(Renamed(3, 2))) is None
    assert "OwnForward" in ghost_unsupported_reason(nn.Sequential(OwnForward(3, 2)))
    assert "max_norm" in ghost_unsupported_reason(nn.Sequential(nn.Embedding(5, 2, max_norm=1.0)))
    assert "sparse" in ghost_unsupported_reason(nn.Sequential(nn.Embedding(5, 2, sparse=True)))
