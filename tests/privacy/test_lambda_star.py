"""Tests of fedfdp.analysis.lambda_star (spec §2)."""

from __future__ import annotations

import doctest
import logging

import numpy as np
import pytest

from fedfdp.errors import ConfigError
from fedfdp.analysis import lambda_star
from fedfdp.analysis.lambda_star import (
    BoundConstants,
    bound_coefficients,
    bound_objective,
    cardano_roots,
    derivative_numerator_coeffs,
    optimal_lambda,
)

BASE = dict(G=0.1, L=10.0, mu=0.5, Gamma=0.5, Q0=0.1, Q1=3.0, sigma=2.0, C=1.0, d=582_026.0,
            B_hat=30.0, init_dist_sq=10.0)


def constants(**overrides: float) -> BoundConstants:
    return BoundConstants(**{**BASE, **overrides})


def real_numpy_roots(a: tuple[float, ...]) -> np.ndarray:
    r = np.roots(derivative_numerator_coeffs(a))  # type: ignore[arg-type]
    return np.sort(r[np.abs(r.imag) <= 1e-7 * np.maximum(1.0, np.abs(r))].real)


def random_coefficients(rng: np.random.Generator) -> tuple[float, float, float, float, float]:
    a1, a2, a4, a5 = 10.0 ** rng.uniform(-2, 2, size=4)
    a3 = a4 * a5 * rng.uniform(0.01, 0.99)  # positive and a3 < a4*a5 (spec §2.3)
    return (a1, a2, a3, a4, a5)


def test_coefficients_by_hand() -> None:
    c = constants()
    a1, a2, a3, a4, a5 = bound_coefficients(c)
    assert a1 == pytest.approx(0.01 * 27)
    assert a2 == pytest.approx(6 * 0.01 * 9)
    assert a3 == pytest.approx(9 * 3 * 0.01 + 2 * 10 * 0.5 * 3 + 2 * 0.1 * 10)
    assert a4 == pytest.approx(4 * 0.01 + 2 * 10 * 0.5 + 2 * 4 * 582_026 / 900 + 10)
    assert a5 == pytest.approx(0.2)
    b = bound_coefficients(c, variant="mu_corrected")
    assert b[2] - a3 == pytest.approx(2 * 0.1 * 10 * (0.25 - 1))
    assert b[3] - a4 == pytest.approx(10 * (0.25 - 1))


def test_cardano_matches_numpy_roots() -> None:
    rng = np.random.default_rng(0)
    three_real = 0
    for _ in range(300):
        a = random_coefficients(rng)
        expected, got = real_numpy_roots(a), cardano_roots(a)
        assert got.shape == expected.shape
        scale = np.max(np.abs(expected))
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-9 * scale)
        # The paper's claim under a5 > 0 and a3 < a4*a5: exactly one positive root.
        assert np.sum(got > 0) == 1
        three_real += got.size == 3
    assert 0 < three_real < 300  # both Cardano branches (R < 0 and R > 0) were exercised


def test_cardano_needs_a_cubic() -> None:
    with pytest.raises(ConfigError, match="a1"):
        cardano_roots((1.0, 1.0, 1.0, 1.0, 0.0))


def test_derivative_numerator_matches_finite_differences() -> None:
    rng = np.random.default_rng(1)
    for _ in range(50):
        a = random_coefficients(rng)
        lam = rng.uniform(0.0, 5.0)
        h = 1e-6 * max(1.0, lam)
        fd = (bound_objective(lam + h, a) - bound_objective(lam - h, a)) / (2 * h)
        exact = np.polyval(derivative_numerator_coeffs(a), lam) / (a[4] * lam + 1) ** 2
        assert fd == pytest.approx(exact, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("seed", range(30))
def test_optimal_lambda_beats_the_grid(seed: int) -> None:
    rng = np.random.default_rng(seed)
    q0 = rng.uniform(-3, 1)
    c = constants(
        G=10.0 ** rng.uniform(-2, 1), L=10.0 ** rng.uniform(-1, 2), Gamma=rng.uniform(0, 2),
        Q0=q0, Q1=max(q0, 0.0) + rng.uniform(0, 5), sigma=rng.uniform(0, 3),
        C=10.0 ** rng.uniform(-2, 0), init_dist_sq=rng.uniform(0, 20),
    )
    cap = 100.0
    lam = optimal_lambda(c, lambda_cap=cap)
    pole = 1 / (2 * abs(c.Q0)) if c.Q0 < 0 else np.inf
    assert 0.0 <= lam <= cap and lam < pole
    a = bound_coefficients(c)
    grid = np.linspace(0.0, min(pole, cap), 2001)[:-1]
    assert bound_objective(lam, a) <= np.min(bound_objective(grid, a)) * (1 + 1e-9)


def test_optimal_lambda_grid_cases_include_interior_minima() -> None:
    c = constants(Q0=0.2, Q1=0.5, G=1.0)
    lam = optimal_lambda(c)
    assert 0.0 < lam < 100.0
    a = bound_coefficients(c)
    assert np.polyval(derivative_numerator_coeffs(a), lam) == pytest.approx(0.0, abs=1e-6 * a[3])


def test_optimal_lambda_is_the_papers_root_when_q0_positive() -> None:
    c = constants()
    a = bound_coefficients(c)
    assert a[2] < a[3] * a[4]
    lam = optimal_lambda(c)
    assert lam > 0
    assert lam == pytest.approx(cardano_roots(a).max(), rel=1e-6)


def test_optimal_lambda_respects_the_pole() -> None:
    c = constants(Q0=-1.0, sigma=0.0)  # pole at 0.5
    lam = optimal_lambda(c)
    assert 0.0 <= lam < 0.5


@pytest.mark.parametrize(
    "overrides",
    [
        dict(G=0.0, L=0.0, sigma=0.0, init_dist_sq=0.0),  # objective identically 0
        dict(Gamma=-100.0),  # bound negative: assumptions violated
    ],
)
def test_degenerate_inputs_fall_back(overrides: dict, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=lambda_star.__name__):
        assert optimal_lambda(constants(**overrides), fallback=0.25) == 0.25
    assert "degenerate" in caplog.text


def test_invalid_constants_and_arguments() -> None:
    with pytest.raises(ConfigError, match="mu"):
        constants(mu=0.0)
    with pytest.raises(ConfigError, match="Q0"):
        constants(Q0=2.0, Q1=1.0)
    with pytest.raises(ConfigError, match="B_hat"):
        constants(B_hat=0.0)
    with pytest.raises(ConfigError, match="G"):
        constants(G=float("nan"))
    with pytest.raises(ConfigError, match="lambda_cap"):
        optimal_lambda(constants(), lambda_cap=0.0)
    with pytest.raises(ConfigError, match="variant"):
        bound_coefficients(constants(), variant="other")  # type: ignore[arg-type]


def test_docstring_examples() -> None:
    assert doctest.testmod(lambda_star).failed == 0
