"""Empirical lower bounds on ε from one training run (Steinke, Nasr and Jagielski 2023, arXiv 2305.08846).

``m`` canaries are each included in the run independently with probability ½. After training, an
auditor scores every canary, guesses "included" for the ``k`` highest scores and "excluded" for
the ``k`` lowest, and abstains on the rest: ``r = 2k`` guesses, ``v`` of them right. If the run is
(ε, δ)-DP, the number of right guesses is dominated by ``Binomial(r, e^ε / (1 + e^ε))`` up to a
δ term (their Theorem 5.2; the p-value of their Appendix D, Algorithm 1 of the paper)::

    p(ε) = P[Bin(r, p_ε) ≥ v] + 2 m δ · max_{1 ≤ i ≤ v} P[v − i ≤ Bin(r, p_ε) < v] / i,   p_ε = 1/(1 + e^{−ε})

and the run is not (ε, δ)-DP for any ε with ``p(ε) < 1 − confidence``: the largest such ε is the
empirical lower bound. Several guess sizes ``k`` are tried with the confidence split among them
(Bonferroni), so the reported bound holds at the stated confidence whichever ``k`` gave it.

Written by hand: neither Opacus, dp-accounting nor Lightning ships a one-run audit (jax_privacy's
needs JAX); the formula is checked against its limits in ``tests/privacy/test_audit.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

__all__ = ["AuditBound", "epsilon_lower_bound", "one_run_bound", "p_value"]

#: The guess sizes tried, as fractions of the canaries (k = fraction · m / 2 on each side).
GUESS_FRACTIONS: tuple[float, ...] = (0.05, 0.1, 0.2, 0.5, 1.0)


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Probability of ``v`` or more right guesses out of ``r`` (of ``m`` canaries) from an (ε, δ)-DP run."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    q = 1.0 / (1.0 + math.exp(-epsilon))
    beta = float(stats.binom.sf(v - 1, r, q))
    if delta == 0 or v == 0:
        return min(beta, 1.0)
    below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)  # P[Bin = v - i], i = 1..v
    alpha = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))
    return min(beta + alpha * delta * 2 * m, 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float = 0.95) -> float:
    """The largest ε with ``p_value(ε) < 1 − confidence`` (0 when even ε = 0 is not rejected), by bisection."""
    level = 1.0 - confidence
    if p_value(m, r, v, 0.0, delta) >= level:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(m, r, v, high, delta) < level:
        low, high = high, 2 * high
        if high > 100:
            return low
    for _ in range(60):
        mid = (low + high) / 2
        if p_value(m, r, v, mid, delta) < level:
            low = mid
        else:
            high = mid
    return low


@dataclass(frozen=True)
class AuditBound:
    """One audit's outcome: the bound, and the guesses that gave it."""

    lower_bound: float
    confidence: float
    canaries: int
    guesses: int
    correct: int

    def as_dict(self) -> dict[str, float | int]:
        """For ``summary.json``."""
        return {"lower_bound": self.lower_bound, "confidence": self.confidence, "canaries": self.canaries,
                "guesses": self.guesses, "correct": self.correct}


def one_run_bound(scores: Sequence[float] | np.ndarray, included: Sequence[bool] | np.ndarray, delta: float,
                  confidence: float = 0.95, fractions: Sequence[float] = GUESS_FRACTIONS) -> AuditBound:
    """The best bound over guess sizes ``k`` (``fractions`` of ``m/2`` a side), each tested at
    ``1 − (1 − confidence) / len(fractions)`` (Bonferroni), so the bound holds at ``confidence``."""
    scores, included = np.asarray(scores, dtype=np.float64), np.asarray(included, dtype=bool)
    m = len(scores)
    order = np.argsort(-scores, kind="stable")  # highest first
    each = 1.0 - (1.0 - confidence) / len(fractions)
    best = AuditBound(0.0, confidence, m, 0, 0)
    for fraction in fractions:
        k = max(1, int(fraction * m / 2))
        right = int(included[order[:k]].sum() + (~included[order[m - k:]]).sum())
        bound = epsilon_lower_bound(m, 2 * k, right, delta, each)
        if bound > best.lower_bound:
            best = AuditBound(bound, confidence, m, 2 * k, right)
    return best
