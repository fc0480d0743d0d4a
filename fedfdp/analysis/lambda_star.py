"""Optimal fairness parameter λ* from the convergence bound (spec §2; paper Sec. VI J / Sec. 6 C).

Theorem 1 (Eq. 16 J) bounds E[F(w_T)] − F* by P(λ) = (L / 2μT) · 𝓕(λ) (Eq. 17) once the fair
clip factor is bracketed by 1 + Q0·λ ≤ C_t^{i,j} ≤ 1 + Q1·λ (Sec. VI J)::

    𝓕(λ) = (a1 λ³ + a2 λ² + a3 λ + a4) / (a5 λ + 1)
    a1 = G² Q1³,  a2 = 6 G² Q1²,  a3 = 9 Q1 G² + 2 L Γ Q1 + 2 Q0 D,
    a4 = 4 G² + 2 L Γ + 2 σ² C² d / B̂² + D,  a5 = 2 Q0,   D = E‖w_1 − w*‖².

𝓕′ (Eq. 18) has numerator 𝒢(λ) = 2a1a5 λ³ + (3a1 + a2a5) λ² + 2a2 λ + (a3 − a4a5) (Eq. 19),
which the paper solves with Cardano (Eq. 22 and the root formulas after it), taking
λ* = the largest real root. Its "unique positive root" needs Q0 > 0 and a3 < a4a5; with Q0 < 0
there is a pole at λ = 1/(2|Q0|) (spec §2.3), so :func:`optimal_lambda` minimises 𝓕
numerically over the feasible interval instead.
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass, fields
from typing import Literal

import numpy as np

from fedfdp.errors import ConfigError

__all__ = [
    "BoundConstants", "bound_coefficients", "bound_objective", "cardano_roots",
    "derivative_numerator_coeffs", "optimal_lambda",
]

log = logging.getLogger(__name__)

Coefficients = tuple[float, float, float, float, float]
_POLE_MARGIN = 1e-6  # the open end next to the pole is evaluated at λ_max · (1 − margin)


@dataclass(frozen=True, kw_only=True)
class BoundConstants:
    """Constants of Theorem 1 (spec §2.1, estimates in §2.4).

    Attributes:
        G: per-sample gradient-norm bound.
        L: smoothness constant.
        mu: strong-convexity constant (> 0).
        Gamma: heterogeneity Γ = F* − Σ p_i F_i*.
        Q0: lower bound of Δ = sample loss − F̄ (≤ Q1).
        Q1: upper bound of Δ.
        sigma: noise multiplier of the model step.
        C: per-sample clip bound.
        d: number of model parameters.
        B_hat: smallest batch size min_i |B_i| (> 0).
        init_dist_sq: E‖w_1 − w*‖².

    Raises:
        ConfigError: a non-finite value, a negative G/L/sigma/C/d/init_dist_sq, mu or B_hat ≤ 0,
            or Q0 > Q1.
    """

    G: float
    L: float
    mu: float
    Gamma: float
    Q0: float
    Q1: float
    sigma: float
    C: float
    d: float
    B_hat: float
    init_dist_sq: float

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise ConfigError(f"BoundConstants.{f.name} must be a finite number, got {v!r}")
        for name in ("G", "L", "sigma", "C", "d", "init_dist_sq"):
            if getattr(self, name) < 0:
                raise ConfigError(f"BoundConstants.{name} must be >= 0, "
                                  f"got {getattr(self, name)!r}")
        for name in ("mu", "B_hat"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"BoundConstants.{name} must be > 0, got {getattr(self, name)!r}")
        if self.Q0 > self.Q1:
            raise ConfigError(f"BoundConstants.Q0 must be <= Q1, got Q0={self.Q0!r}, "
                              f"Q1={self.Q1!r}")


def bound_coefficients(c: BoundConstants, *,
                       variant: Literal["paper", "mu_corrected"] = "paper") -> Coefficients:
    """Coefficients (a1, …, a5) of 𝓕 (spec §2.2; below Eq. 17 J).

    ``variant="mu_corrected"`` multiplies D = E‖w_1 − w*‖² by μ² in a3 and a4, the consistent
    factorisation of Theorem 1 (spec §2.3 caveat 2); ``"paper"`` is the paper's expression.
    """
    if variant not in ("paper", "mu_corrected"):
        raise ConfigError(f"lambda_star variant must be one of paper, mu_corrected; "
                          f"got {variant!r}")
    dist = c.init_dist_sq * (c.mu**2 if variant == "mu_corrected" else 1.0)
    g2 = c.G**2
    a1 = g2 * c.Q1**3
    a2 = 6.0 * g2 * c.Q1**2
    a3 = 9.0 * c.Q1 * g2 + 2.0 * c.L * c.Gamma * c.Q1 + 2.0 * c.Q0 * dist
    a4 = 4.0 * g2 + 2.0 * c.L * c.Gamma + 2.0 * c.sigma**2 * c.C**2 * c.d / c.B_hat**2 + dist
    a5 = 2.0 * c.Q0
    return (a1, a2, a3, a4, a5)


def bound_objective(lam: float | np.ndarray, a: Coefficients) -> float | np.ndarray:
    """𝓕(λ) = (a1λ³ + a2λ² + a3λ + a4)/(a5λ + 1); the bound is P(λ) = (L / 2μT) · 𝓕(λ) (Eq. 17).

    >>> bound_objective(1.0, (1.0, 1.0, 1.0, 1.0, 1.0))
    2.0
    """
    a1, a2, a3, a4, a5 = a
    return (((a1 * lam + a2) * lam + a3) * lam + a4) / (a5 * lam + 1.0)


def derivative_numerator_coeffs(a: Coefficients) -> tuple[float, float, float, float]:
    """Coefficients of 𝒢, highest power first (``numpy.roots`` order); d𝓕/dλ = 𝒢(λ)/(a5λ + 1)².

    𝒢(λ) = 2a1a5 λ³ + (3a1 + a2a5) λ² + 2a2 λ + (a3 − a4a5)   (Eqs. 18–19 J).
    """
    a1, a2, a3, a4, a5 = a
    return (2.0 * a1 * a5, 3.0 * a1 + a2 * a5, 2.0 * a2, a3 - a4 * a5)


def cardano_roots(a: Coefficients, *, imag_tol: float = 1e-7) -> np.ndarray:
    """Real roots of 𝒢 by the paper's closed form (spec §2.2; Eq. 22 J ff.), sorted ascending.

    λ = x − (a2a5 + 3a1)/(6a1a5) turns 𝒢 into x³ + a6 x + a7 with
    a6 = −(3a1 − a2a5)²/(12a1²a5²),
    a7 = [108a1²a5²(a3 − a4a5) − 36a1a2a5(3a1 + a2a5) + 2(3a1 + a2a5)³]/(216a1³a5³);
    R = a7²/4 + a6³/27, u = ∛(−a7/2 + √R) (complex), v = −a6/(3u) (so that uv = −a6/3, the
    pairing of Cardano's v = ∛(−a7/2 − √R)), x_k = ω^k u + ω^{−k} v with ω = e^{2πi/3}.
    A root is real when |Im x| ≤ imag_tol · max(1, |x|).

    Raises:
        ConfigError: a1·a5 == 0 (𝒢 is not a cubic).
    """
    a1, a2, a3, a4, a5 = (float(x) for x in a)
    if a1 * a5 == 0:
        raise ConfigError(f"cardano_roots needs a1*a5 != 0 (G, Q1 and Q0 nonzero), got a={a!r}")
    b = 3.0 * a1 + a2 * a5
    shift = b / (6.0 * a1 * a5)
    a6 = -((3.0 * a1 - a2 * a5) ** 2) / (12.0 * a1**2 * a5**2)
    a7 = (108.0 * a1**2 * a5**2 * (a3 - a4 * a5) - 36.0 * a1 * a2 * a5 * b + 2.0 * b**3) / (
        216.0 * a1**3 * a5**3)
    sqrt_r = np.sqrt(complex(a7**2 / 4.0 + a6**3 / 27.0))
    w = -a7 / 2.0 + sqrt_r
    if abs(w) < abs(-a7 / 2.0 - sqrt_r):  # the larger branch avoids cancellation
        w = -a7 / 2.0 - sqrt_r
    u = w ** (1.0 / 3.0) if w != 0 else 0.0
    v = -a6 / (3.0 * u) if u != 0 else 0.0
    omega = complex(-0.5, math.sqrt(3.0) / 2.0)
    xs = [u + v, omega * u + omega.conjugate() * v, omega.conjugate() * u + omega * v]
    real = [x.real - shift for x in map(complex, xs) if abs(x.imag) <= imag_tol * max(1.0, abs(x))]
    return np.sort(np.asarray(real, dtype=np.float64))


def optimal_lambda(c: BoundConstants, *, lambda_cap: float = 100.0, fallback: float = 0.1,
                   variant: Literal["paper", "mu_corrected"] = "paper") -> float:
    """λ* = argmin of 𝓕 over the feasible interval (spec §2.3 recommended algorithm).

    Feasible: [0, λ_max) with λ_max = 1/(2|Q0|) (the pole, where 2C_t − 1 = 0) if Q0 < 0, else
    ``lambda_cap``; the cap also applies when the pole lies beyond it. Candidates are the real
    roots of 𝒢 (``numpy.roots``) inside the interval plus both ends (the open end just inside
    the pole); the one with the smallest 𝓕 is returned (the smaller λ on ties). Degenerate
    inputs (no finite positive 𝓕: the bound's assumptions fail) log a warning and return
    ``fallback``. The paper's own rule (largest real Cardano root) is :func:`cardano_roots`.

    Raises:
        ConfigError: lambda_cap not finite and > 0, or fallback not finite and ≥ 0.
    """
    if not (math.isfinite(lambda_cap) and lambda_cap > 0):
        raise ConfigError(f"lambda_cap must be a finite number > 0, got {lambda_cap!r}")
    if not (math.isfinite(fallback) and fallback >= 0):
        raise ConfigError(f"lambda fallback must be a finite number >= 0, got {fallback!r}")
    a = bound_coefficients(c, variant=variant)
    pole = 1.0 / (2.0 * abs(c.Q0)) if c.Q0 < 0 else math.inf
    if pole <= lambda_cap:
        lam_max, upper = pole, pole * (1.0 - _POLE_MARGIN)
    else:
        lam_max, upper = lambda_cap, lambda_cap
    coeffs = np.asarray(derivative_numerator_coeffs(a), dtype=np.float64)
    candidates = [0.0, upper]
    if np.all(np.isfinite(coeffs)) and np.any(coeffs != 0):
        for r in np.roots(coeffs):
            if abs(r.imag) <= 1e-9 * max(1.0, abs(r)) and 0.0 <= r.real < lam_max:
                candidates.append(float(r.real))
    candidates.sort()
    with np.errstate(all="ignore"):
        values = np.array([bound_objective(x, a) for x in candidates], dtype=np.float64)
    if not np.all(np.isfinite(values) & (values > 0)):
        log.warning("optimal_lambda: bound is degenerate for %s (objective values %s); "
                    "using lambda=%s", c, values.tolist(), fallback)
        return float(fallback)
    return float(candidates[int(np.argmin(values))])
