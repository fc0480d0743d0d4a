"""The privacy accountant's interface: what the federation, the algorithms, the Flower apps and the reports use.

A run has at most one accountant, handed to the federation at setup by the callback that configures
it (``callbacks.RDPAccounting``, through :meth:`fedfdp.interfaces.FederationHooks.provided_accountant`;
:func:`run_accountant_of` collects it and refuses a second). The interface is the size of Opacus'
``IAccountant`` or Flower's: compose an event, ε at the run's δ, would the next events exceed the
budget, state; plus the settings a reader needs (δ, the target, the unit of ε). What the guarantee
also rests on are collaborators of their own: the ledgers and their durable file
(:class:`fedfdp.privacy.ledger.RunLedger`), the round planning and per-round guard
(:class:`fedfdp.privacy.budget.BudgetPlan`) and the start-up checks (:mod:`fedfdp.privacy.start_checks`).
The implementation is :class:`fedfdp.privacy.run_accountant.RunAccountant` (Opacus' RDP or PRV
accountant for the maths).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from fedfdp.errors import ConfigError

if TYPE_CHECKING:
    from fedfdp.privacy.accounting import DPEvent

__all__ = ["PlannedEvents", "PrivacyAccountant", "run_accountant_of"]

#: A client's DP events of one round, ``(kind, event)`` pairs, by client id (``Federation.planned_dp_events``).
PlannedEvents = Callable[[int], Sequence[tuple[str, "DPEvent"]]]


class PrivacyAccountant(Protocol):
    """The run's privacy accountant.

    Attributes:
        delta: δ of every ε.
        target_epsilon: the budget ε (None: account only).
    """

    delta: float
    target_epsilon: float | None

    @property
    def unit(self) -> str:
        """What the run's ε hides: ``record`` (one record of any client) or ``client`` (one client of the
        population, a client-level mechanism)."""
        ...

    def compose(self, client_id: int, events: Sequence[tuple[str, DPEvent]], *, round_idx: int) -> None:
        """Charge ``events`` (``(kind, event)`` pairs) that ``client_id`` releases, before they are used
        (written to the durable ledger first)."""
        ...

    def epsilon(self) -> float:
        """ε spent so far at δ, in the run's unit (inf for a run without a guarantee)."""
        ...

    def client_epsilon(self, client_id: int) -> float:
        """ε spent so far by one client's records (0 for a client that never trained)."""
        ...

    def would_exceed(self, client_id: int, events: Sequence[tuple[str, DPEvent]]) -> bool:
        """Whether charging ``events`` would take ``client_id`` past the budget."""
        ...

    def mark_non_private(self) -> None:
        """A release without a guarantee ran (allowed for analysis only): ε is infinite from now on."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        ...


def run_accountant_of(callbacks: Iterable[Any]) -> PrivacyAccountant | None:
    """The accountant the run's callbacks hand over (each callback's ``provided_accountant()``), or None.

    The one place that collects it: a run has exactly one ledger of its releases, so a second
    accountant (e.g. added with ``--trainer.callbacks+=``) is refused, rather than letting each
    reader pick its own.

    Raises:
        ConfigError: more than one accountant.
    """
    found = [acc for acc in (getattr(cb, "provided_accountant", lambda: None)() for cb in callbacks)
             if acc is not None]
    if len(found) > 1:
        raise ConfigError(f"trainer.callbacks has {len(found)} privacy accountants "
                          f"({', '.join(type(acc).__name__ for acc in found)}); a run has exactly one: "
                          f"remove all but one")
    return found[0] if found else None
