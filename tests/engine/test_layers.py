"""fedfdp.models.layers.MaxPool2d is nn.MaxPool2d, bit for bit, on inputs nobody listed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fedfdp
from fedfdp.models import FedAvgCNN, HuCNN, RCDPFLCNN, ScatterCNN, TinyCNN
from fedfdp.models.layers import MaxPool2d


def _random_case(rng: np.random.Generator) -> tuple[dict, torch.Tensor]:
    """A random pooling configuration and an input with ties, zeros, infinities and NaNs."""
    kernel = tuple(int(k) for k in rng.integers(1, 5, size=2)) if rng.random() < 0.5 else int(rng.integers(1, 5))
    pair = kernel if isinstance(kernel, tuple) else (kernel, kernel)
    stride = None if rng.random() < 0.4 else int(rng.integers(1, 4))
    dilation = 1 if rng.random() < 0.7 else int(rng.integers(1, 3))
    padding = int(rng.integers(0, min(pair) // 2 + 1))
    ceil_mode = bool(rng.random() < 0.3)
    span = [dilation * (k - 1) + 1 for k in pair]
    height, width = (int(rng.integers(s, s + 12)) for s in span)
    shape = (int(rng.integers(1, 6)), int(rng.integers(1, 9)), height, width)
    kind = rng.integers(0, 4)
    if kind == 0:  # continuous values
        values = rng.standard_normal(shape)
    elif kind == 1:  # many exact ties (post-ReLU activations are full of zeros)
        values = np.maximum(rng.integers(-3, 3, size=shape), 0).astype(float)
    elif kind == 2:  # constant windows
        values = np.full(shape, float(rng.integers(-2, 3)))
    else:  # non-finite values among ties
        values = rng.integers(-2, 3, size=shape).astype(float)
        special = rng.random(shape)
        values[special < 0.05] = np.nan
        values[(special >= 0.05) & (special < 0.1)] = np.inf
        values[(special >= 0.1) & (special < 0.15)] = -np.inf
    dtype = torch.float64 if rng.random() < 0.3 else torch.float32
    config = dict(kernel_size=kernel, stride=stride, padding=padding, dilation=dilation, ceil_mode=ceil_mode)
    return config, torch.tensor(values, dtype=dtype)


def _forward_backward(pool: nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = x.clone().requires_grad_()
    out = pool(leaf)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    out.backward(grad_out)
    return out.detach(), leaf.grad


@pytest.mark.parametrize("case", range(300))
def test_max_pool_matches_torch_bitwise_forward_and_gradient(case: int) -> None:
    config, x = _random_case(np.random.default_rng(case))
    expected, expected_grad = _forward_backward(nn.MaxPool2d(**config), x, case)
    got, got_grad = _forward_backward(MaxPool2d(**config), x, case)
    assert got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got_grad, expected_grad, rtol=0, atol=0, equal_nan=True)
    with torch.no_grad():  # the inference path (no indices) too
        torch.testing.assert_close(MaxPool2d(**config)(x), F.max_pool2d(x, **config), rtol=0, atol=0, equal_nan=True)


def _second_order(pool: nn.Module, x: torch.Tensor, seed: int) -> torch.Tensor:
    """``H v`` of ``sum(pool(x)³)`` by double backward (what FinP's curvature probe does through a CNN)."""
    leaf = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad((pool(leaf) ** 3).sum(), leaf, create_graph=True)
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed), dtype=x.dtype)
    (hv,) = torch.autograd.grad(grad, leaf, grad_outputs=v)
    return hv


@pytest.mark.parametrize("case", range(0, 300, 7))
def test_max_pool_double_backward_matches_torch_bitwise(case: int) -> None:
    config, x = _random_case(np.random.default_rng(case))
    x = torch.nan_to_num(x, nan=0.5, posinf=3.0, neginf=-3.0)
    torch.testing.assert_close(_second_order(MaxPool2d(**config), x, case), _second_order(nn.MaxPool2d(**config), x, case),
                               rtol=0, atol=0)


def test_max_pool_inside_vmap_per_sample_gradients_matches_torch() -> None:
    from torch.func import grad, vmap

    x = torch.randn(5, 3, 8, 8)

    def per_sample(pool: nn.Module) -> torch.Tensor:
        return vmap(grad(lambda sample: (pool(sample[None]) ** 2).sum()))(x)

    torch.testing.assert_close(per_sample(MaxPool2d(2)), per_sample(nn.MaxPool2d(2)), rtol=0, atol=0)


@pytest.mark.parametrize("x", [torch.randn(3, 6, 6), torch.randn(2, 3, 6, 6).contiguous(memory_format=torch.channels_last),
                               torch.randn(2, 3, 6, 8)[..., ::2], torch.randn(2, 1, 1, 1)],
                         ids=["unbatched", "channels_last", "strided", "one_channel_one_pixel"])
def test_max_pool_other_layouts_take_torchs_path(x: torch.Tensor) -> None:
    torch.testing.assert_close(MaxPool2d(2, ceil_mode=True)(x), nn.MaxPool2d(2, ceil_mode=True)(x), rtol=0, atol=0)


def test_max_pool_with_indices_is_torchs() -> None:
    x = torch.randn(2, 3, 8, 8)
    got, got_idx = MaxPool2d(2, return_indices=True)(x)
    expected, expected_idx = nn.MaxPool2d(2, return_indices=True)(x)
    assert torch.equal(got, expected) and torch.equal(got_idx, expected_idx)


@pytest.mark.parametrize("make", [lambda: FedAvgCNN(), lambda: HuCNN(), lambda: RCDPFLCNN(), lambda: TinyCNN(),
                                  lambda: ScatterCNN()], ids=["FedAvgCNN", "HuCNN", "RCDPFLCNN", "TinyCNN", "ScatterCNN"])
def test_shipped_models_pool_with_the_fast_layer(make) -> None:
    pools = [m for m in make().modules() if isinstance(m, nn.MaxPool2d)]
    assert pools and all(type(m) is MaxPool2d for m in pools)


def test_no_module_of_the_package_builds_torchs_2d_max_pool() -> None:
    """A model added later pools with the fast layer too (the layer itself is the one exception)."""
    package = Path(fedfdp.__file__).parent
    offenders = [f"{path.relative_to(package)}:{number}" for path in sorted(package.rglob("*.py"))
                 if path.name != "layers.py"
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if "nn.MaxPool2d(" in line or "max_pool2d(" in line]
    assert not offenders, f"use fedfdp.models.layers.MaxPool2d: {offenders}"
