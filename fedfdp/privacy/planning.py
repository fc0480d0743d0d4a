"""Round planning for a privacy budget: how many more rounds every client can afford.

A client that takes part in each round spends its planned per-round events every round on top of
what its ledger already holds; :func:`fedfdp.privacy.accounting.max_rounds` finds the rounds that
keep its ε within the target. The run can afford the fewest over its clients (any client may be
sampled in every round). Clients with equal plans and equal histories share one search.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

from fedfdp.errors import ConfigError, PrivacyBudgetError
from fedfdp.privacy.accounting import Accountant, DPEvent, epsilon_of, max_rounds

__all__ = ["affordable_rounds"]


def affordable_rounds(clients: Iterable[tuple[Sequence[DPEvent], Sequence[DPEvent]]], *, target_epsilon: float,
                      delta: float, orders: Sequence[float], rule: Literal["strict", "paper_code"],
                      accountant: Accountant, spent_epsilon: float, cap: int | None = None) -> int:
    """The rounds every client can still afford within ``target_epsilon`` (at least 1).

    Args:
        clients: per client (in order, read lazily), ``(per-round events, spent events)``: the
            budget-counted events one round of it charges, and those its ledger already holds.
        target_epsilon, delta, orders, rule, accountant, cap: as :func:`~fedfdp.privacy.accounting.max_rounds`.
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
