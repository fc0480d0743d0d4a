"""Round planning for a privacy budget: how many more rounds every client can afford.

A client that takes part in each round spends its planned per-round events every round on top of
what its ledger already holds; :func:`max_rounds` finds the rounds that keep its ε within the
target (by the accountant's own arithmetic, :mod:`fedfdp.privacy.accounting`). The run can afford
the fewest over its clients (any client may be sampled in every round). Clients with equal plans
and equal histories share one search.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Literal

from fedfdp.errors import ConfigError, PrivacyBudgetError
from fedfdp.privacy.accounting import (PAPER_ORDERS, Accountant, DPEvent, _check_accountant, _check_delta,
                                       _check_orders, _epsilon_from_rdp, epsilon_of, merged_rdp, prv_epsilon,
                                       rdp_of)

__all__ = ["MAX_ROUNDS", "affordable_rounds", "max_rounds"]

MAX_ROUNDS = 10**6
"""The most rounds a run may plan (a few days at a tenth of a second per round)."""

#: Start of the authors' bisection bracket over steps, and its ε tolerance (``get_max_steps``).
_CODE_STEPS_HIGH = 100_000
_CODE_EPS_TOLERANCE = 0.01


def affordable_rounds(clients: Iterable[tuple[Sequence[DPEvent], Sequence[DPEvent]]], *, target_epsilon: float,
                      delta: float, orders: Sequence[float], rule: Literal["strict", "paper_code"],
                      accountant: Accountant, spent_epsilon: float, cap: int | None = None) -> int:
    """The rounds every client can still afford within ``target_epsilon`` (at least 1).

    Args:
        clients: per client (in order, read lazily), ``(per-round events, spent events)``: the
            budget-counted events one round of it charges, and those its ledger already holds.
        target_epsilon, delta, orders, rule, accountant, cap: as :func:`max_rounds`.
        spent_epsilon: the budget-counted ε already spent (maximum over clients), for the message
            of a budget that is already spent.

    Raises:
        ConfigError: a client's round releases nothing private (a budget with nothing to count).
        PrivacyBudgetError: not one more round fits: the budget is spent, or too small for one round.
    """
    limits: dict[tuple[tuple[DPEvent, ...], tuple[DPEvent, ...]], int] = {}
    for per_round, spent in clients:
        events, history = tuple(per_round), tuple(spent)
        if not events:
            raise ConfigError("RDPAccounting.target_epsilon is set but the run releases nothing private "
                              "(noise_multiplier 0?); set target_epsilon: null or a noise multiplier > 0")
        key = (events, history)
        if key not in limits:
            limits[key] = max_rounds(events, target_epsilon=target_epsilon, delta=delta, orders=orders, rule=rule,
                                     spent=history, accountant=accountant, cap=cap)
    remaining = min(limits.values())
    if remaining > 0:
        return remaining
    if spent_epsilon > 0:
        raise PrivacyBudgetError(
            f"the privacy ledger already holds epsilon={spent_epsilon:.4f} of RDPAccounting.target_epsilon="
            f"{target_epsilon}; not one more round fits: nothing left to train")
    (events, _), = [key for key, limit in limits.items() if limit == 0][:1]
    one_round = epsilon_of(events, delta, orders, accountant)
    raise PrivacyBudgetError(f"RDPAccounting.target_epsilon={target_epsilon} is too small for a "
                             f"single round at delta={delta}: one round spends epsilon={one_round:.4g}; "
                             f"raise target_epsilon above it or the noise multiplier")


def max_rounds(per_round: Sequence[DPEvent], *, target_epsilon: float, delta: float,
               orders: Sequence[float] = PAPER_ORDERS,
               rule: Literal["strict", "paper_code"] = "strict", spent: Sequence[DPEvent] = (),
               accountant: Accountant = "rdp", cap: int | None = None) -> int:
    """Rounds T affordable at ``(target_epsilon, delta)`` when every round spends ``per_round``.

    With ``cap``, the search stops once more than ``cap`` rounds are known to fit and returns
    ``cap + 1`` (a run may not plan that many: :data:`fedfdp.plan.MAX_ROUNDS`).

    ε(T) = conversion(R_spent + T · R_round) is strictly increasing in T (RDP is linear in T,
    Theorem 2); ``spent`` are the events already charged (a resumed run), R_spent their RDP.
    0 when even T = 0 exceeds the target. ``accountant="prv"`` bisects on the PRV accountant's
    ε instead (strict rule only).

    * ``"strict"``: the largest integer T ≥ 0 with ε(T) ≤ target (exponential + integer
      bisection; exactly consistent with :func:`epsilon_of` of the T-fold events).
    * ``"paper_code"``: the authors' ``get_max_steps`` (one1Mouth/FedFDP,
      ``system/flcore/optimizers/utils/RDP/get_max_steps.py``, called from
      ``Server._reset_global_rounds_by_epsilon``): a bisection over *real-valued* T on
      [0, 100000] keeping the upper end while ε(hi) − target > 0.01 (mid = (lo+hi)/2;
      ε(mid) > target → hi = mid, else lo = mid), then ``max(1, int(hi))``. It can overshoot
      the target by up to 0.01 (3.52 → 778 rounds at ε = 3.523; strict gives 776). Their code
      raised if ε(100000) < target; here the bracket is doubled instead. The code used the
      model step only (``per_round=[model_step]``) and then runs ``range(T + 1)`` rounds; it
      bisected over DP-SGD steps and divided by ``local_iterations``, which is the same as
      bisecting over rounds here when a round is one step.

    Raises:
        ConfigError: bad target/delta/rule, or a round that spends nothing.
    """
    if rule not in ("strict", "paper_code"):
        raise ConfigError(f"max_rounds rule must be one of strict, paper_code; got {rule!r}")
    _check_accountant(accountant)
    if accountant == "prv" and rule != "strict":
        raise ConfigError("rounds_rule paper_code is the authors' RDP bisection; use rounds_rule strict with "
                          "accountant prv")
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ConfigError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    _check_delta(delta)
    orders_t = _check_orders(orders)
    per_round = list(per_round)
    if not all(isinstance(e, DPEvent) for e in per_round):
        raise ConfigError(f"max_rounds per_round must be a list of DPEvent, got {per_round!r}")
    if not any(e.steps for e in per_round):
        raise ConfigError("max_rounds per_round must contain at least one event with steps >= 1")
    unit = rdp_of(per_round, orders_t)
    already = merged_rdp(spent, orders_t)  # the arithmetic of PrivacyLedger.projected_epsilon

    def eps(t: float) -> float:  # strict: the same arithmetic as epsilon_of(repeated events)
        if accountant == "prv":
            return prv_epsilon([*spent, *(e.repeated(int(t)) for e in per_round)], delta)
        if rule == "strict":
            rdp = already + rdp_of((e.repeated(int(t)) for e in per_round), orders_t)
        else:
            rdp = already + unit * t
        with warnings.catch_warnings():  # "optimal order is the largest alpha" while searching
            warnings.simplefilter("ignore")
            return _epsilon_from_rdp(rdp, orders_t, delta)

    if eps(0) > target_epsilon:
        return 0
    if rule == "paper_code":
        lo, hi = 0.0, float(_CODE_STEPS_HIGH)
        eps_hi = eps(hi)
        while eps_hi < target_epsilon:
            if cap is not None and hi > cap:
                return cap + 1
            if hi > 2**53:
                raise ConfigError("max_rounds: per-round RDP is ~0, the rounds are unbounded")
            lo, hi = hi, 2 * hi
            eps_hi = eps(hi)
        while eps_hi - target_epsilon > _CODE_EPS_TOLERANCE:
            mid = (lo + hi) / 2
            e = eps(mid)
            if e > target_epsilon:
                hi, eps_hi = mid, e
            else:
                lo = mid
        return max(1, int(hi))

    lo_i, hi_i = 0, 1  # invariant: eps(lo_i) <= target < eps(hi_i)
    while eps(hi_i) <= target_epsilon:
        if cap is not None and hi_i > cap:
            return cap + 1
        if hi_i > 2**53:
            raise ConfigError("max_rounds: per-round RDP is ~0, the rounds are unbounded")
        lo_i, hi_i = hi_i, 2 * hi_i
    while hi_i - lo_i > 1:
        mid_i = (lo_i + hi_i) // 2
        if eps(mid_i) <= target_epsilon:
            lo_i = mid_i
        else:
            hi_i = mid_i
    return lo_i
