"""The budget's collaborator of the accountant: how many rounds fit, and the guard before each round.

:class:`BudgetPlan` reads the run's ledgers (:class:`fedfdp.privacy.ledger.RunLedger`, which holds
every release made, replayed rounds included) and answers two questions for the accounting
callback: how many rounds the budget allows from here (:meth:`BudgetPlan.planned_rounds`, by
:func:`fedfdp.privacy.planning.affordable_rounds`), and whether the next round would take any
client (or, with a client-level mechanism, the population) past the target
(:meth:`BudgetPlan.check_round`, which asks the accountant's :meth:`would_exceed
<fedfdp.privacy.accountant.PrivacyAccountant.would_exceed>`). It charges nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from fedfdp.errors import PrivacyBudgetError
from fedfdp.privacy.accountant import PlannedEvents
from fedfdp.privacy.accounting import Accountant, DPEvent
from fedfdp.privacy.ledger import RunLedger
from fedfdp.privacy.planning import MAX_ROUNDS, affordable_rounds
from fedfdp.types import POPULATION

__all__ = ["BudgetPlan"]


class _Budgeted(Protocol):
    """What the plan reads of its accountant (:class:`fedfdp.privacy.run_accountant.RunAccountant`)."""

    target_epsilon: float | None
    delta: float
    orders: tuple[float, ...]
    rounds_rule: str
    accountant: Accountant
    population_size: int | None
    ledger: RunLedger

    def budgeted_epsilon(self) -> float: ...
    def would_exceed(self, client_id: int, events: Sequence[tuple[str, DPEvent]]) -> bool: ...
    def projected_epsilon(self, client_id: int, events: Sequence[tuple[str, DPEvent]]) -> float: ...
    def start_round_charges(self) -> None: ...


class BudgetPlan:
    """Round planning and the per-round budget guard of one accountant (``rounds_rule``: strict or paper_code)."""

    def __init__(self, accountant: _Budgeted) -> None:
        self.accountant = accountant

    def planned_rounds(self, num_clients: int, planned: PlannedEvents, start_round: int,
                       population: Sequence[tuple[str, DPEvent]] = ()) -> int | None:
        """The round count (from round 0) at which the budget is spent, given what is already charged.

        ``start_round`` rounds are done (the checkpoint's round, 0 for a fresh start); the ledgers
        already hold every release made so far, replayed rounds included. The rounds still
        affordable are those that keep every client's ε ≤ target if it takes part in each
        (:func:`fedfdp.privacy.planning.affordable_rounds`); ``planned(client)`` is one round's events.
        With a client-level mechanism the budget is the client unit's: the rounds that keep the
        population's ε (one round: ``population``) within the target.
        """
        acc = self.accountant
        if acc.target_epsilon is None:
            return None
        ledger = acc.ledger
        if acc.population_size is not None:
            clients: Iterable[tuple[Sequence[DPEvent], Sequence[DPEvent]]] = [
                (ledger.counted(population), ledger.spent_budget_events(POPULATION))]
        else:
            clients = ((ledger.counted(planned(cid)), ledger.spent_budget_events(cid)) for cid in range(num_clients))
        remaining = affordable_rounds(clients, target_epsilon=acc.target_epsilon, delta=acc.delta, orders=acc.orders,
                                      rule=acc.rounds_rule, accountant=acc.accountant,  # type: ignore[arg-type]
                                      spent_epsilon=acc.budgeted_epsilon(), cap=MAX_ROUNDS)
        return start_round + remaining

    def check_round(self, round_idx: int, client_ids: Sequence[int], planned: PlannedEvents,
                    population: Sequence[tuple[str, DPEvent]] = ()) -> None:
        """Start round ``round_idx`` (0-based): refuse it if it would take any client past the budget
        (strict rule only).

        Raises:
            PrivacyBudgetError: a client's projected ε after the round exceeds ``target_epsilon``.
        """
        acc = self.accountant
        acc.start_round_charges()
        if acc.target_epsilon is None or acc.rounds_rule != "strict":
            return
        if acc.population_size is not None:
            if acc.would_exceed(POPULATION, population):
                projected = acc.projected_epsilon(POPULATION, population)
                raise PrivacyBudgetError(
                    f"round {round_idx} would spend epsilon={projected:.4f} for a client of the population, over "
                    f"RDPAccounting.target_epsilon={acc.target_epsilon}; the budget is exhausted")
            return
        for cid in client_ids:
            if acc.would_exceed(cid, planned(cid)):
                projected = acc.projected_epsilon(cid, planned(cid))
                raise PrivacyBudgetError(
                    f"round {round_idx} would spend epsilon={projected:.4f} for client {cid}, over "
                    f"RDPAccounting.target_epsilon={acc.target_epsilon}; the budget is exhausted")
