"""Fairness-in-privacy metrics (FinP spec ``finp.md`` §2-3): SIA attribution and its dispersion.

Notation: ``ell[k, j, n]`` is the loss of candidate model ``k`` on target record ``n`` of source
client ``j`` (``K`` models × ``K`` sources × ``N`` records). The source inference attack names the
model with the smallest loss (ties: lowest index); ``a_j`` is the fraction of client ``j``'s
targets attributed to ``j`` (Eq. 5, a per-client true-positive rate). ``M[j, k] = mean_n ell[k, j, n]``
is the loss-based "confidence" matrix. All functions are pure.

Used by the source inference audit (:mod:`callbacks.sia`), FinP's dispersion term
(:mod:`fedfdp.algorithms.finp`) and the FinP table harness (:mod:`fedfdp.experiments.finp`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fedfdp.metrics import jain_index


def sia_predictions(ell: Tensor) -> Tensor:
    """``pred[j, n] = argmin_k ell[k, j, n]`` (first index wins on ties), shape (K, N)."""
    return ell.argmin(dim=0)


def sia_accuracy(ell: Tensor) -> Tensor:
    """Per-source SIA accuracy ``a_j = (1/N) Σ_n 1[pred[j, n] = j]`` (Eq. 5), shape (K,).

    >>> sia_accuracy(torch.tensor([[[0.1], [0.9]], [[0.5], [0.2]]])).tolist()  # ell[k, j, n]
    [1.0, 1.0]
    """
    sources = torch.arange(ell.shape[1], device=ell.device)[:, None]
    return (sia_predictions(ell) == sources).double().mean(dim=1)


def sia_loss_matrix(ell: Tensor) -> Tensor:
    """``M[j, k] = mean_n ell[k, j, n]``: mean loss of model ``k`` on source ``j``'s targets, (K, K)."""
    return ell.double().mean(dim=2).T


def sia_true_posterior(ell: Tensor) -> Tensor:
    """Confidence variant: mean soft posterior ``P[j | x] = softmax_k(−ell[k, j, n])`` of the true source, (K,)."""
    post = torch.softmax(-ell.double(), dim=0)
    k = ell.shape[1]
    return post[torch.arange(k), torch.arange(k)].mean(dim=1)


def cov(values: Sequence[float] | Tensor) -> float:
    """Coefficient of variation ``std/mean`` with population std (ddof = 0) (Eq. 6); 0 when mean is 0.

    >>> round(cov([1.0, 3.0]), 6)
    0.5
    """
    x = torch.as_tensor(values, dtype=torch.float64)
    mean = float(x.mean())
    return float(x.std(unbiased=False)) / mean if mean != 0 else 0.0


def eod(values: Sequence[float] | Tensor) -> float:
    """Equal-opportunity difference ``max_i a_i − min_j a_j`` (Eq. 8).

    >>> eod([0.2, 0.5, 0.1])
    0.4
    """
    x = torch.as_tensor(values, dtype=torch.float64)
    return round(float(x.max() - x.min()), 12)


def loss_cov(matrix: Tensor) -> float:
    """CoV(Loss): ``(1/K) Σ_j std_k(M[j, k]) / mean_k(M[j, k])`` (spec §3, the authors' code)."""
    m = matrix.double()
    return float((m.std(dim=1, unbiased=False) / m.mean(dim=1).clamp_min(1e-12)).mean())


def fairness_in_privacy(ell: Tensor) -> dict[str, float]:
    """One round's SIA metrics from the loss tensor ``ell`` (K, K, N); accuracies as fractions.

    Keys: ``sia_acc`` (mean_j a_j), ``sia_max_client`` (max_j a_j), ``sia_cov``, ``sia_fi``
    (Jain = 1/(1 + CoV²)), ``sia_eod``, ``sia_loss_cov``, ``sia_loss_fi`` (FI of the averaged CoV),
    ``sia_posterior`` (mean true-source posterior), ``sia_chance`` (1/K).
    """
    acc = sia_accuracy(ell)
    lcov = loss_cov(sia_loss_matrix(ell))
    return {"sia_acc": float(acc.mean()), "sia_max_client": float(acc.max()), "sia_cov": cov(acc),
            "sia_fi": jain_index(acc) if float(acc.sum()) > 0 else 1.0, "sia_eod": eod(acc),
            "sia_loss_cov": lcov, "sia_loss_fi": 1.0 / (1.0 + lcov**2),
            "sia_posterior": float(sia_true_posterior(ell).mean()), "sia_chance": 1.0 / ell.shape[0]}


def summarize_rounds(history: Sequence[dict[str, float]]) -> dict[str, float]:
    """Table values over rounds (spec §3): means of per-round metrics; Max = max_t of the client mean.

    Mean(SIA) and Max(SIA) are returned in percent as ``sia_table_mean`` / ``sia_table_max``.
    """
    if not history:
        return {}
    keys = ("sia_cov", "sia_fi", "sia_eod", "sia_loss_cov", "sia_loss_fi", "sia_posterior", "sia_max_client")
    out = {f"{k}_avg": sum(h[k] for h in history) / len(history) for k in keys}
    out["sia_table_mean"] = 100.0 * sum(h["sia_acc"] for h in history) / len(history)
    out["sia_table_max"] = 100.0 * max(h["sia_acc"] for h in history)
    out["sia_rounds"] = float(len(history))
    return out


def convergence_round(rounds: Sequence[int], accuracy: Sequence[float], *, last: int = 5,
                      fraction: float = 0.98) -> int | None:
    """First evaluated round whose accuracy is ≥ fraction × (mean of the last ``last`` evaluations)
    and stays there (spec §3 "Converge" [rec]); None without evaluations.

    >>> convergence_round([1, 2, 3, 4], [0.1, 0.9, 0.5, 0.95], last=2)
    4
    """
    if not accuracy:
        return None
    level = fraction * sum(accuracy[-last:]) / len(accuracy[-last:])
    first = len(accuracy) - 1
    for i in range(len(accuracy) - 1, -1, -1):
        if accuracy[i] < level:
            break
        first = i
    return int(rounds[first])
