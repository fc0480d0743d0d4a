"""Rényi-DP accounting for FedFDP (spec §3; paper Sec. VII J, Theorems 2–4).

Every privatised release is a Poisson-subsampled Gaussian mechanism (SGM) with sampling rate
``q`` and noise multiplier ``σ``. Its RDP, the composition (a sum of RDP curves) and the RDP →
(ε, δ) conversion all come from Opacus (:mod:`opacus.accountants.analysis.rdp`); nothing here
re-derives them. For integer orders α ≥ 2 (spec §3.3–3.4; paper J numbering)::

    A_α(q, σ) = Σ_{k=0}^{α} C(α, k) (1 − q)^{α−k} q^k exp((k² − k) / (2σ²))         (Eq. 27)
    R(α)      = Σ_events steps · log A_α(q, σ) / (α − 1)   (Eqs. 24, 28; the paper drops the log)
    ε         = min_α R(α) + log((α − 1)/α) − (log δ + log α)/(α − 1)   (Eq. 23, Lemma 1)

R_model (Theorem 3, Eq. 24, σ) and R_loss (Theorem 4, Eq. 28, σ_l) add up (Theorem 2); the
conversion is Balle et al. (AISTATS 2020), Opacus' ``get_privacy_spent``.

The reference table of spec §3.6 is reproduced in ``tests/privacy/test_accounting.py``.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any, Literal

import numpy as np
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

from fedfdp.errors import ConfigError, PrivacyError
from fedfdp.types import DPEvent  # the event value object lives with the other value objects

logger = logging.getLogger(__name__)

__all__ = ["ACCOUNTANTS", "OPACUS_DEFAULT_ORDERS", "PAPER_ORDERS", "DPEvent", "PrivacyLedger", "epsilon_of",
           "merged_rdp", "prv_epsilon", "rdp_of", "uncovered_steps"]

#: RDP orders of the authors' code (``list(range(2, 64)) + [128, 256, 512]``, spec §3.4).
PAPER_ORDERS: tuple[float, ...] = tuple(float(a) for a in (*range(2, 64), 128, 256, 512))
#: Opacus' default orders (``RDPAccountant.DEFAULT_ALPHAS``: 1.1, 1.2, …, 10.9, 12, …, 63).
OPACUS_DEFAULT_ORDERS: tuple[float, ...] = tuple(float(a) for a in RDPAccountant.DEFAULT_ALPHAS)

#: The accountants: ``rdp`` (Opacus' RDPAccountant, the paper's) or ``prv`` (Opacus' PRVAccountant,
#: Gopi et al. 2021: numerical composition of privacy-loss random variables, tighter).
Accountant = Literal["rdp", "prv"]
ACCOUNTANTS: tuple[str, ...] = ("rdp", "prv")
#: ε accuracy of the PRV accountant; its reported ε is the upper end of its error bracket.
PRV_EPS_ERROR = 0.01


def _check_orders(orders: Sequence[float]) -> tuple[float, ...]:
    try:  # rdp_of runs for every client of every round: check each tuple of orders once
        checked = _CHECKED_ORDERS.get(orders) if isinstance(orders, tuple) else None  # type: ignore[call-overload]
    except TypeError:  # an unhashable element: checked (and refused) below
        checked = None
    if checked is not None:
        return checked
    try:
        out = tuple(float(a) for a in orders)
    except (TypeError, ValueError):
        out = ()
    if not out or not all(math.isfinite(a) and a > 1 for a in out):
        raise ConfigError(f"orders must be a non-empty list of finite numbers > 1, got {orders!r}")
    if isinstance(orders, tuple) and len(_CHECKED_ORDERS) < 64:
        _CHECKED_ORDERS[orders] = out
    return out


#: tuples of orders already checked -> their checked form (floats)
_CHECKED_ORDERS: dict[tuple[object, ...], tuple[float, ...]] = {}


def _check_delta(delta: float) -> None:
    if not 0 < delta < 1:
        raise ConfigError(f"delta must be in (0, 1), got {delta!r}")


@lru_cache(maxsize=1024)
def _unit_rdp(sample_rate: float, noise_multiplier: float, orders: tuple[float, ...]) -> np.ndarray:
    rdp = np.asarray(compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1,
                                 orders=list(orders)), dtype=np.float64)
    rdp.setflags(write=False)
    return rdp


def rdp_of(events: Iterable[DPEvent], orders: Sequence[float] = PAPER_ORDERS) -> np.ndarray:
    """RDP curve of the composition of ``events``: R(α) = Σ steps · R_SGM(α; q, σ) (Eqs. 24, 28).

    Per-event curves are Opacus' ``compute_rdp`` (cached per (q, σ, orders)); composition is
    their sum, which is linear in ``steps``.

    >>> step = DPEvent(noise_multiplier=2.0, sample_rate=0.05)
    >>> round(float(rdp_of([step], [2.0])[0]), 7)
    0.0007098
    """
    orders_t = _check_orders(orders)
    total = np.zeros(len(orders_t))
    for e in events:
        unit = _unit_rdp(float(e.sample_rate), float(e.noise_multiplier), orders_t)
        total = total + unit * e.steps
    return total


def merged_rdp(events: Iterable[DPEvent], orders: Sequence[float] = PAPER_ORDERS) -> np.ndarray:
    """:func:`rdp_of` with equal mechanisms merged first (alternating model/loss events of a
    history do not merge in Opacus' history; summing per mechanism is exact and O(mechanisms))."""
    return rdp_of((DPEvent(noise_multiplier=s, sample_rate=q, steps=n) for s, q, n in _merged(events)), orders)


def _epsilon_from_rdp(rdp: np.ndarray, orders: tuple[float, ...], delta: float) -> float:
    if not np.any(rdp > 0):  # nothing released: (0, 0)-DP, as the authors' compute_eps returns
        return 0.0
    eps, _ = get_privacy_spent(orders=list(orders), rdp=rdp, delta=delta)
    # Balle et al.'s conversion goes below 0 for large δ; ε < 0 means nothing ((ε, δ)-DP is
    # monotone in ε), so the tightest true statement is ε = 0
    return max(0.0, float(eps))


def epsilon_of(events: Iterable[DPEvent], delta: float,
               orders: Sequence[float] = PAPER_ORDERS, accountant: Accountant = "rdp") -> float:
    """ε of the composition of ``events`` at ``delta`` (spec §3.4; Theorem 2, Eq. 23 J).

    ``rdp``: ε = min_α [R(α) + log((α−1)/α) − (log δ + log α)/(α−1)] with R = :func:`rdp_of`; the
    conversion is Opacus' ``get_privacy_spent`` (Balle et al., AISTATS 2020, Thm 21).
    ``prv``: :func:`prv_epsilon` (``orders`` unused). No event (or only zero-step events) gives 0.0.

    >>> round(epsilon_of([DPEvent(noise_multiplier=2.0, sample_rate=0.05, steps=778)], 1e-5), 3)
    3.523
    """
    _check_delta(delta)
    if accountant == "prv":
        return prv_epsilon(events, delta)
    _check_accountant(accountant)
    orders_t = _check_orders(orders)
    return _epsilon_from_rdp(rdp_of(events, orders_t), orders_t, delta)


def _check_accountant(accountant: str) -> None:
    if accountant not in ACCOUNTANTS:
        raise ConfigError(f"accountant must be one of {list(ACCOUNTANTS)}, got {accountant!r}")


def _merged(events: Iterable[DPEvent]) -> tuple[tuple[float, float, int], ...]:
    """The composition as ``(σ, q, steps)`` per distinct mechanism, in order of first appearance."""
    merged: dict[tuple[float, float], int] = {}
    for e in events:
        key = (float(e.noise_multiplier), float(e.sample_rate))
        merged[key] = merged.get(key, 0) + int(e.steps)
    return tuple((s, q, n) for (s, q), n in merged.items() if n > 0)


def prv_epsilon(events: Iterable[DPEvent], delta: float) -> float:
    """ε of the composition of ``events`` by Opacus' ``PRVAccountant`` (Gopi et al., NeurIPS 2021).

    The privacy-loss distributions of the distinct mechanisms are discretised and composed by
    FFT; heterogeneous histories (model and loss releases with different σ) compose exactly. The
    value returned is the upper end of the accountant's bracket (error ``PRV_EPS_ERROR`` in ε,
    δ/1000 in δ), so it is a valid guarantee. Cached per composition.

    >>> step, loss = DPEvent(noise_multiplier=2.0, sample_rate=0.05, steps=683), DPEvent(noise_multiplier=5.0, sample_rate=0.05, steps=683)
    >>> prv_epsilon([step, loss], 1e-5) < epsilon_of([step, loss], 1e-5)
    True
    """
    _check_delta(delta)
    return _prv_epsilon_cached(_merged(events), float(delta))


@lru_cache(maxsize=4096)
def _prv_epsilon_cached(history: tuple[tuple[float, float, int], ...], delta: float) -> float:
    if not history:
        return 0.0
    accountant = PRVAccountant()
    accountant.history = list(history)
    try:
        return max(0.0, float(accountant.get_epsilon(delta, eps_error=PRV_EPS_ERROR)))  # ε < 0 means nothing
    except RuntimeError as err:  # Opacus' root finding can fail far out (e.g. σ 7, q 1, δ 0.97)
        events = [DPEvent(noise_multiplier=s, sample_rate=q, steps=n) for s, q, n in history]
        fallback = epsilon_of(events, delta)
        logger.warning("PRV accountant: %s at delta=%g; reporting the RDP bound %.4f instead (also valid, "
                       "possibly looser)", err, delta, fallback)
        return fallback


class PrivacyLedger:
    """Per-client privacy ledger (style §4.4) over an Opacus :class:`RDPAccountant`.

    Each recorded mechanism goes through ``RDPAccountant.step`` (its ``history`` is the state);
    ε is computed with this ledger's ``orders`` (default :data:`PAPER_ORDERS`).

    Args:
        orders: RDP orders used for every ε this ledger reports.

    Attributes:
        accountant: the wrapped ``RDPAccountant``; its ``get_optimizer_hook_fn`` may be attached
            to a ``DPOptimizer`` directly, the steps then land in the same history.
    """

    def __init__(self, *, orders: Sequence[float] = PAPER_ORDERS, accountant_kind: Accountant = "rdp") -> None:
        _check_accountant(accountant_kind)
        self.orders: tuple[float, ...] = _check_orders(orders)
        self.accountant_kind = accountant_kind
        self.accountant = RDPAccountant()

    def record(self, event: DPEvent) -> None:
        """Charge ``event`` (``event.steps`` accountant steps)."""
        if not isinstance(event, DPEvent):
            raise ConfigError(f"PrivacyLedger.record expects a DPEvent, got {type(event).__name__}")
        for _ in range(event.steps):
            self.accountant.step(noise_multiplier=event.noise_multiplier,
                                 sample_rate=event.sample_rate)

    def record_dpsgd_step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Charge one DP-SGD step with Poisson rate ``sample_rate``."""
        self.record(DPEvent(noise_multiplier=noise_multiplier, sample_rate=sample_rate))

    def record_gaussian_release(self, *, noise_multiplier: float, sample_rate: float = 1.0) -> None:
        """Charge one noisy scalar release (q = 1 unless computed on a Poisson sample)."""
        self.record(DPEvent(noise_multiplier=noise_multiplier, sample_rate=sample_rate))

    @property
    def events(self) -> tuple[DPEvent, ...]:
        """The accountant's history as events (consecutive equal mechanisms merged)."""
        return tuple(DPEvent(noise_multiplier=s, sample_rate=q, steps=n)
                     for s, q, n in self.accountant.history)

    @property
    def num_events(self) -> int:
        """Number of mechanism applications recorded so far (the sum of ``steps``)."""
        return sum(int(n) for _, _, n in self.accountant.history)

    def _rdp(self) -> np.ndarray:
        return merged_rdp(self.events, self.orders)

    def epsilon(self, delta: float) -> float:
        """ε spent so far at ``delta`` (equals ``epsilon_of(self.events, delta, self.orders)``)."""
        _check_delta(delta)
        if self.accountant_kind == "prv":
            return prv_epsilon(self.events, delta)
        return _epsilon_from_rdp(self._rdp(), self.orders, delta)

    def projected_epsilon(self, events: Iterable[DPEvent], delta: float) -> float:
        """ε if ``events`` were spent on top of the record, without recording them."""
        _check_delta(delta)
        if self.accountant_kind == "prv":
            return prv_epsilon([*self.events, *events], delta)
        return _epsilon_from_rdp(self._rdp() + rdp_of(events, self.orders), self.orders, delta)

    def state_dict(self) -> dict[str, Any]:
        """Plain-python state: ``{"orders": [float], "history": [[σ, q, steps], ...]}``."""
        return {"orders": list(self.orders),
                "history": [[float(s), float(q), int(n)] for s, q, n in self.accountant.history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (orders included); validates every entry.

        A ledger only grows: loading into a ledger that already holds charges is allowed only when
        the loaded history holds every one of them (:func:`uncovered_steps`), else
        :class:`~fedfdp.errors.PrivacyError` — a load never forgets spent budget.
        """
        if set(state_dict) != {"orders", "history"}:
            raise ConfigError("PrivacyLedger state must have exactly the keys orders, history; "
                              f"got {sorted(state_dict)}")
        orders = _check_orders(state_dict["orders"])
        history = state_dict["history"]
        if not all(isinstance(h, (list, tuple)) and len(h) == 3 for h in history):
            raise ConfigError(f"PrivacyLedger history must be [[sigma, q, steps], ...], "
                              f"got {history!r}")
        events = [DPEvent(noise_multiplier=s, sample_rate=q, steps=n) for s, q, n in history]
        missing = uncovered_steps(self.events, events)
        if missing:
            raise PrivacyError(f"PrivacyLedger.load_state_dict would forget {missing} charged mechanism steps: a ledger "
                               "only grows, so the loaded history must hold every step already recorded")
        self.orders = orders
        self.accountant.history = [(e.noise_multiplier, e.sample_rate, e.steps) for e in events]


def _steps_by_mechanism(events: Iterable[DPEvent]) -> Counter[tuple[float, float]]:
    counts: Counter[tuple[float, float]] = Counter()
    for event in events:
        counts[(float(event.noise_multiplier), float(event.sample_rate))] += int(event.steps)
    return counts


def uncovered_steps(recorded: Iterable[DPEvent], history: Iterable[DPEvent]) -> int:
    """How many mechanism steps of ``recorded`` ``history`` lacks (0: ``history`` covers them).

    Compared as multisets of ``(σ, q)`` steps: RDP composition is order-independent, so a history
    that holds every recorded step (in any order, possibly with more) spends at least the
    recorded ε. A positive count means a load of ``history`` would forget charges.
    """
    have = _steps_by_mechanism(history)
    return sum(max(0, n - have[key]) for key, n in _steps_by_mechanism(recorded).items())
