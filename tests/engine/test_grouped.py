"""The grouped network: G models in one pass give each model's own per-sample results."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from fedfdp.grad_sample.grouped import GroupedNetwork
from fedfdp.grad_sample.engine import GhostEngine, per_sample_cross_entropy


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 6, 3),
                         nn.Tanh(), nn.Flatten(), nn.Linear(6 * 2 * 2, 8), nn.ReLU(), nn.Linear(8, 3))


def _linear() -> nn.Module:
    return nn.Sequential(nn.GroupNorm(2, 4, affine=False), nn.Flatten(), nn.Linear(4 * 3 * 3, 3))


def _resnet() -> nn.Module:
    from fedfdp.models import ResNetGN
    return ResNetGN(depth=8, num_classes=3, in_channels=1, base_width=4, groups=2)


class _TokenNet(nn.Module):
    """Embedding (with a padding row) -> LayerNorm -> mean over positions -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6, padding_idx=0)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.norm(self.embed(x)).mean(1))


def _tokens(n: int) -> torch.Tensor:
    return torch.randint(0, 11, (n, 5))


def _frozen() -> nn.Module:
    net = _cnn()
    net[3].weight.requires_grad_(False)  # a frozen layer: the same in every model, not in the flat vector
    return net


@pytest.mark.parametrize("make, shape", [(_cnn, (1, 8, 8)), (_linear, (4, 3, 3)), (_frozen, (1, 8, 8)),
                                         (_resnet, (1, 8, 8)), (_TokenNet, _tokens)],
                         ids=["cnn", "scatter-linear", "frozen-layer", "groupnorm-resnet", "embedding-layernorm"])
@pytest.mark.parametrize("sizes", [[5, 0, 7, 3], [9]], ids=["four-models", "one-model"])
def test_grouped_pass_equals_each_model_alone(make, shape, sizes):
    torch.manual_seed(0)
    net = make()
    trainable = [p for p in net.parameters() if p.requires_grad]
    models = [parameters_to_vector(trainable).detach() + 0.3 * torch.randn(sum(p.numel() for p in trainable))
              for _ in sizes]
    x = shape(sum(sizes)) if callable(shape) else torch.randn(sum(sizes), *shape)
    y = torch.randint(0, 3, (sum(sizes),))
    grouped = GroupedNetwork(net, per_sample_cross_entropy)
    result = grouped.compute(torch.stack(models), sizes, x, y)
    weights = torch.rand(sum(sizes))
    # client segments inside the groups: the second group's rows split into two clients
    offsets = [0]
    for size in sizes:
        cut = offsets[-1] + size // 2
        offsets += [cut, offsets[-1] + size]
    sums = result.segment_weighted_sums(weights, offsets)
    start = 0
    for g, size in enumerate(sizes):
        alone = make()
        vector_to_parameters(models[g], [p for p in alone.parameters() if p.requires_grad])
        for p, q in zip(alone.parameters(), net.parameters()):
            if not q.requires_grad:
                p.data.copy_(q.data)
        rows = slice(start, start + size)
        if size:
            own = GhostEngine(alone).compute(x[rows], y[rows])
            torch.testing.assert_close(result.losses[rows], own.losses, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(result.norms[rows], own.norms, rtol=1e-4, atol=1e-6)
            mid = size // 2
            for seg, (lo, hi) in enumerate([(0, mid), (mid, size)]):
                expected = own.segment_weighted_sums(weights[rows], [0, lo, hi, size])[1]
                for got, want in zip(sums[2 * g + seg], expected):
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        start += size


def test_grouped_network_refuses_a_layer_with_its_own_forward():
    class Scaled(nn.Linear):
        def forward(self, x):  # noqa: D102
            return 2 * super().forward(x)

    with pytest.raises(ValueError, match="its own forward"):
        GroupedNetwork(nn.Sequential(Scaled(3, 2)), per_sample_cross_entropy)


def test_grouped_evaluation_equals_each_clients_model_alone():
    """fedfdp.metrics.evaluate_grouped: one pass, each client's rows through its own model."""
    from fedfdp.metrics import evaluate_clientwise, evaluate_grouped

    torch.manual_seed(0)
    net = _cnn()
    trainable = [p for p in net.parameters() if p.requires_grad]
    base = parameters_to_vector(trainable).detach()
    models = torch.stack([base + 0.3 * torch.randn_like(base) for _ in range(3)])
    client_id = torch.tensor([0] * 7 + [1] * 4 + [2] * 9)
    x, y = torch.randn(20, 1, 8, 8), torch.randint(0, 3, (20,))
    grouped = GroupedNetwork(net, per_sample_cross_entropy)
    got = evaluate_grouped(grouped, models, per_sample_cross_entropy, x, y, client_id, 3, batch_size=6)
    for cid in range(3):
        vector_to_parameters(models[cid], trainable)
        rows = client_id == cid
        alone = evaluate_clientwise(net, per_sample_cross_entropy, x[rows], y[rows], client_id[rows], 3)
        torch.testing.assert_close(got["accuracy"][cid], alone["accuracy"][cid])
        torch.testing.assert_close(got["loss"][cid], alone["loss"][cid], rtol=1e-5, atol=1e-6)
