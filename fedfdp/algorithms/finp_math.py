"""Pure maths of FinP (seed 003, spec ``finp.md`` §1): curvature, rank ρ, PCA/ALA weights, Lipschitz bound.

Everything here takes tensors / arrays and plain numbers, never a trainer or a client (the state is
:mod:`fedfdp.algorithms.finp`'s and :mod:`fedfdp.algorithms.finp_client`'s):

- :func:`hessian_vector_product` / :func:`power_iteration` / :func:`hutchinson_trace`: the client's
  curvature statistics ``(λ_max, tr H)`` of its plain cross-entropy at the local model (spec §1.2).
- :func:`overfitting_rank`: the relative overfitting rank ρ (Eq. 1).
- :func:`gram_matrix`, :func:`pca_distances`, :func:`pca_weights`: the server's PCA adaptive
  aggregation (Eq. 4/10) through the exact Gram shortcut ``p_k(w)² = G_kk − 2(Gw)_k + wᵀGw``
  (PCA with ``n_components = K`` on ``K + 1`` points keeps all variance, so PCA distances are
  Euclidean distances; spec §1.5 finding 1). :func:`explicit_pca_distances` is the sklearn path.
- :func:`ala_weights`: adaptive lightweight aggregation ``w_k ∝ 1 − ρ_k`` (spec §1.6).
- :func:`log_lipschitz_bound`: ``log ‖J‖`` of estimators A (row-norm product) and B (spectral);
  :func:`rownorm_bound_rows`: estimator A's value and its gradient's non-zero rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn

Vec = list[Tensor]
HVP = Callable[[Vec], Vec]
LipschitzEstimator = Literal["rownorm_product", "spectral_product"]
_LIPSCHITZ_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.ConvTranspose2d)


# ---- curvature (spec §1.2) ------------------------------------------------------------------------
def _dot(a: Vec, b: Vec) -> Tensor:
    return sum((x * y).sum() for x, y in zip(a, b))  # type: ignore[return-value]


def _normalise(v: Vec) -> Vec:
    norm = torch.sqrt(_dot(v, v)).clamp_min(1e-12)
    return [x / norm for x in v]


def hessian_vector_product(net: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor], x: Tensor,
                           y: Tensor) -> tuple[HVP, list[Tensor]]:
    """``v ↦ H v`` for the mean loss of ``net`` on ``(x, y)`` (double backprop; graph built once).

    Returns the closure and the parameters it differentiates (those with ``requires_grad``).
    """
    params = [p for p in net.parameters() if p.requires_grad]
    loss = loss_fn(net(x), y).mean()
    grads = torch.autograd.grad(loss, params, create_graph=True)

    def hvp(v: Vec) -> Vec:
        out = torch.autograd.grad(grads, params, grad_outputs=v, retain_graph=True, allow_unused=True)
        return [torch.zeros_like(p) if o is None else o.detach() for p, o in zip(params, out)]

    return hvp, params


def power_iteration(hvp: HVP, like: Sequence[Tensor], *, max_iter: int = 100, tol: float = 1e-3,
                    generator: torch.Generator | None = None) -> float:
    """Eigenvalue of largest magnitude of ``H`` (sign kept): ``λ ← ⟨Hv, v⟩, v ← Hv/‖Hv‖`` (spec §1.2)."""
    # drawn on the generator's device (a seeded CPU stream gives the same probes on any device)
    v = _normalise([torch.randn(p.shape, generator=generator, dtype=p.dtype,
                                device=p.device if generator is None else generator.device).to(p.device)
                    for p in like])
    lam: float | None = None
    for _ in range(max_iter):
        hv = hvp(v)
        new = float(_dot(hv, v))
        v = _normalise(hv)
        if lam is not None and abs(new - lam) / (abs(lam) + 1e-6) < tol:
            return new
        lam = new
    return float(lam if lam is not None else 0.0)


def hutchinson_trace(hvp: HVP, like: Sequence[Tensor], *, max_iter: int = 100, tol: float = 1e-3,
                     generator: torch.Generator | None = None) -> float:
    """Hutchinson's ``tr H ≈ mean_i zᵢᵀ H zᵢ`` with Rademacher ``zᵢ``, stopped at relative change < tol."""
    samples: list[float] = []
    prev = 0.0
    for _ in range(max_iter):
        z = [torch.randint(0, 2, p.shape, generator=generator, device=p.device if generator is None
                           else generator.device).to(p.device, p.dtype) * 2 - 1 for p in like]
        samples.append(float(_dot(hvp(z), z)))
        mean = sum(samples) / len(samples)
        if abs(mean - prev) / (abs(prev) + 1e-6) < tol:
            break
        prev = mean
    return sum(samples) / len(samples)


def curvature_stats(net: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, y: Tensor, *,
                    max_iter: int = 20, tol: float = 5e-3, generator: torch.Generator | None = None
                    ) -> tuple[float, float]:
    """``(λ_max, tr H)`` of the plain mean loss at the current weights, model in ``eval()`` (spec §1.2)."""
    was_training = net.training
    net.eval()
    try:
        hvp, params = hessian_vector_product(net, loss_fn, x, y)
        lam = power_iteration(hvp, params, max_iter=max_iter, tol=tol, generator=generator)
        trace = hutchinson_trace(hvp, params, max_iter=max_iter, tol=tol, generator=generator)
    finally:
        net.train(was_training)
    return lam, trace


# ---- relative overfitting rank (Eq. 1) ------------------------------------------------------------
def overfitting_rank(lams: Sequence[float] | Tensor, traces: Sequence[float] | Tensor) -> Tensor:
    """ρ_k = (Δ̄_k / max Δ̄ + H̄_k / max H̄) / 2 with Δ̄_k = mean_{j≠k} |λ_k − λ_j| (Eq. 1).

    A term whose maximum is 0 contributes 0; ``K = 1`` gives ρ = 0 (spec §1.3 edge cases).

    >>> overfitting_rank([1.0, 1.0, 4.0], [2.0, 2.0, 8.0]).tolist()
    [0.5, 0.5, 1.0]
    """
    out = torch.zeros(len(lams), dtype=torch.float64)
    if len(lams) < 2:
        return out
    for stat in (torch.as_tensor(lams, dtype=torch.float64), torch.as_tensor(traces, dtype=torch.float64)):
        dev = (stat[:, None] - stat[None, :]).abs().sum(1) / (stat.numel() - 1)
        if dev.max() > 0:
            out += dev / dev.max() / 2
    return out


def ala_weights(rho: Sequence[float] | Tensor, sizes: Sequence[int]) -> Tensor:
    """ALA: ``w_k = (1 − ρ_k) / Σ_j (1 − ρ_j)``; size-weighted FedAvg when ``Σ(1 − ρ) = 0`` (spec §1.6).

    >>> ala_weights([0.5, 1.0, 0.0], [1, 1, 1]).tolist()
    [0.3333333333333333, 0.0, 0.6666666666666666]
    """
    keep = 1.0 - torch.as_tensor(rho, dtype=torch.float64)
    if float(keep.sum()) <= 1e-12:
        sizes_t = torch.as_tensor(sizes, dtype=torch.float64)
        return sizes_t / sizes_t.sum()
    return keep / keep.sum()


# ---- PCA adaptive aggregation (Eq. 4/10) ----------------------------------------------------------
def gram_matrix(deltas: Tensor) -> np.ndarray:
    """``G = Δ Δᵀ`` (float64, K×K) of the rows ``δ_k = θ_k − θ_ref``."""
    d = deltas.detach().to(torch.float64)
    return (d @ d.T).cpu().numpy()


def pca_distances(gram: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``p_k(w) = ‖δ_k − Σ_j w_j δ_j‖ = sqrt(G_kk − 2(Gw)_k + wᵀGw)``."""
    gw = gram @ w
    return np.sqrt(np.clip(np.diag(gram) - 2 * gw + w @ gw, 0.0, None))


def _objective(gram: np.ndarray, w: np.ndarray, q: int, gamma: float) -> tuple[float, np.ndarray]:
    """``‖p − mean p‖₂^q + γ mean p`` and its analytic gradient (``∂p_k/∂w = (Gw − G[:, k]) / p_k``)."""
    p = pca_distances(gram, w)
    dev = p - p.mean()
    safe = np.where(p > 1e-12, p, np.inf)
    dp = (gram @ w)[None, :] - gram          # row k: (Gw − G[:, k])ᵀ (G symmetric)
    dp = dp / safe[:, None]
    if q == 2:
        value, grad = float(dev @ dev), 2 * dev @ dp
    else:
        norm = float(np.sqrt(dev @ dev))
        value, grad = norm, (dev @ dp) / max(norm, 1e-12)
    return value + gamma * float(p.mean()), grad + gamma * dp.mean(0)


def pca_weights(gram: np.ndarray, *, q: int = 2, gamma: float = 0.0, x0: np.ndarray | None = None) -> np.ndarray:
    """``argmin_{w ∈ simplex} ‖p(w) − mean p(w)‖^q + γ mean p(w)`` by SLSQP with the analytic gradient.

    ``q = 2, γ = 0`` is the authors' code (default); ``q = 1, γ = 1`` is Eq. 4 as printed. ``G`` is
    rescaled to unit mean diagonal first (the minimiser is scale invariant); start ``x0 = 1/K``.
    """
    from scipy.optimize import minimize

    k = gram.shape[0]
    if k == 1:
        return np.ones(1)
    scale = float(np.trace(gram)) / k
    g = gram / scale if scale > 0 else gram
    start = np.full(k, 1.0 / k) if x0 is None else np.asarray(x0, dtype=np.float64)
    res = minimize(lambda w: _objective(g, w, q, gamma), start, jac=True, method="SLSQP",
                   bounds=[(0.0, 1.0)] * k, constraints=[{"type": "eq", "fun": lambda w: w.sum() - 1.0,
                                                          "jac": lambda w: np.ones_like(w)}],
                   options={"maxiter": 200, "ftol": 1e-10})
    w = np.clip(res.x, 0.0, None)
    return w / w.sum()


def explicit_pca_distances(reference: Tensor, models: Tensor, w: np.ndarray) -> np.ndarray:
    """The authors' path: sklearn ``PCA(n_components=K)`` on ``[g(w), θ_1..θ_K]``, ``‖Z_k − Z_0‖``."""
    from sklearn.decomposition import PCA

    m = models.detach().to(torch.float64).cpu().numpy()
    g = (torch.as_tensor(w, dtype=torch.float64) @ models.detach().to(torch.float64).cpu()).numpy()
    z = PCA(n_components=m.shape[0]).fit_transform(np.vstack([g[None, :], m]))
    return np.linalg.norm(z[1:] - z[0], axis=1)


# ---- client regulariser ‖J‖ (Eq. 2/3, spec §1.4) -------------------------------------------------
def log_lipschitz_bound(net: nn.Module, estimator: LipschitzEstimator = "rownorm_product") -> Tensor:
    """``log L(θ) = Σ_l log f(W_l)`` over Linear/Conv layers (differentiable in the weights only).

    ``rownorm_product`` (estimator A, the authors' code): ``f(W) = max_i ‖W.reshape(out, −1)[i]‖₂``;
    ``spectral_product`` (estimator B): ``f(W) = σ_max(W.reshape(out, −1))``. ReLU, pooling and
    biases count as 1. Data-independent, so its gradient is free under DP.
    """
    total: Tensor | None = None
    for module in net.modules():
        if isinstance(module, _LIPSCHITZ_LAYERS) and module.weight.requires_grad:
            w = module.weight.reshape(module.weight.shape[0], -1)
            f = w.norm(dim=1).max() if estimator == "rownorm_product" else torch.linalg.matrix_norm(w, ord=2)
            term = torch.log(f.clamp_min(1e-12))
            total = term if total is None else total + term
    return total if total is not None else torch.zeros(())


LipschitzRows = list[tuple[Tensor, Tensor, Tensor]]
"""``(weight, rows, grad_rows)`` per layer: the non-zero rows of ``∂ log L / ∂W`` in ``W.reshape(out, −1)``."""


def rownorm_bound_rows(net: nn.Module) -> tuple[Tensor, LipschitzRows] | None:
    """Estimator A's ``log L(θ)`` and its gradient, which is zero outside each layer's largest rows.

    With ``n_i = ‖W[i]‖₂`` and ``f = max_i n_i``: ``∂ log f / ∂W[i] = 1{n_i = f} / (m·f) · W[i] / n_i``
    (``m`` rows tie for the max). FinP adds ``β ρ s ∇log L`` at every local step (Eq. 3); autograd
    forms that gradient densely, a backward through every weight of the model, when only ``m`` rows
    per layer are not zero (on HuCNN 3.7-4.0 ms a step against 1.7-1.9 ms from the rows:
    ``benchmarks/step_profile.py --parts penalty``).
    The rows are computed with autograd's operations in autograd's order (log: ``1 / f``;
    clamp_min: kept where ``f ≥ 1e-12``; max: shared evenly by the tied rows; vector norm:
    ``grad · (W / n)``), so ``g + c · grad`` built from them is bitwise the dense sum
    (``tests/algorithms/test_finp.py``). None where that cannot be promised and the caller must use autograd:
    a weight shared by two layers (autograd would add the two gradients) or a non-finite norm.
    """
    total: Tensor | None = None
    rows: LipschitzRows = []
    maxima = []
    seen: set[int] = set()
    with torch.no_grad():
        for module in net.modules():
            if not (isinstance(module, _LIPSCHITZ_LAYERS) and module.weight.requires_grad):
                continue
            if id(module.weight) in seen:
                return None
            seen.add(id(module.weight))
            w = module.weight.reshape(module.weight.shape[0], -1)
            norms = w.norm(dim=1)
            f = norms.max()
            clamped = f.clamp_min(1e-12)
            term = torch.log(clamped)
            total = term if total is None else total + term
            upstream = torch.where(f >= 1e-12, torch.ones_like(term) / clamped, torch.zeros_like(term))
            tied = norms == f
            hit = tied.nonzero().flatten()
            share = upstream / tied.sum()
            unit = (w[hit] / norms[hit, None]).masked_fill_(norms[hit, None] == 0, 0)
            rows.append((module.weight, hit, share * unit))
            maxima.append(f)
    if total is None:
        return torch.zeros(()), []
    if not bool(torch.isfinite(torch.stack(maxima)).all()):
        return None
    return total, rows


def add_bound_gradient(params: Sequence[Tensor], grads: Sequence[Tensor], rows: LipschitzRows,
                       coeff: float) -> list[Tensor]:
    """``g + coeff · ∂ log L / ∂θ`` for every parameter, from the gradient's non-zero ``rows``.

    A parameter outside the bound (a bias) keeps its gradient object; a weight's gradient is
    copied and only its rows in ``rows`` change (``g + coeff · 0`` is ``g`` elsewhere).
    """
    by_weight = {id(weight): (hit, grad_rows) for weight, hit, grad_rows in rows}
    out = []
    for param, grad in zip(params, grads):
        entry = by_weight.get(id(param))
        if entry is None:
            out.append(grad)
            continue
        hit, grad_rows = entry
        new = grad.clone(memory_format=torch.contiguous_format)
        flat = new.view(new.shape[0], -1)
        flat[hit] = grad.reshape(grad.shape[0], -1)[hit] + coeff * grad_rows
        out.append(new)
    return out
