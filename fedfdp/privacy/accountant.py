"""The privacy accountant's interface: what the federation, the algorithms, the Flower apps and the CLI use.

A run has at most one accountant (:func:`find_accountant`). It charges every DP release of every
client (per-client ledgers, the maximum over clients is the run's ε), keeps them in a durable
ledger file, plans how many rounds the budget allows and refuses a round that would exceed it.
The implementation is :class:`fedfdp.privacy.run_accountant.RunAccountant` (Opacus' RDP or PRV
accountant for the maths); ``callbacks.RDPAccounting`` is that class as a Lightning callback,
which the federation calls at each phase of a round.

Nothing outside :mod:`fedfdp.privacy` needs more of an accountant than this protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from fedfdp.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from fedfdp.privacy.accounting import Accountant, DPEvent
    from fedfdp.privacy.ledger import AccountingMode
    from fedfdp.privacy.validation import DPRelease
    from fedfdp.types import ClientUpdate

__all__ = ["PlannedEvents", "PrivacyAccountant", "find_accountant"]

#: A client's DP events of one round, ``(kind, event)`` pairs, by client id (``Federation.planned_dp_events``).
PlannedEvents = Callable[[int], Sequence[tuple[str, "DPEvent"]]]


class PrivacyAccountant(Protocol):
    """The run's privacy accountant (sample-level DP per client; the run's ε is the maximum over clients).

    Attributes:
        is_privacy_accountant: True: marks the accountant among a run's callbacks (:func:`find_accountant`).
        target_epsilon: the budget ε (None: account only).
        delta: δ of every ε.
        orders: RDP orders of every ε.
        accounting_mode: which releases the budget counts (``theorem2``: all; ``model_only``: the model's).
        accountant: ``rdp`` or ``prv``, the accountant of ε, the plan and the guard.
        ledger_path: the durable ledger file (None: in memory and checkpoints only); the command line
            sets ``<run_dir>/privacy_ledger.jsonl`` (:data:`fedfdp.rundir.LEDGER`).
        allow_non_private: run releases without a guarantee for analysis (ε then infinite).
        repeated_releases: releases charged twice because a session was cut after its last
            checkpoint and the resumed run made them again (``summary.json``'s ``releases_repeated``).
    """

    is_privacy_accountant: ClassVar[bool]
    target_epsilon: float | None
    delta: float
    orders: tuple[float, ...]
    accounting_mode: AccountingMode
    accountant: Accountant
    ledger_path: str | None
    allow_non_private: bool
    repeated_releases: int

    # ---- what a run reads -----------------------------------------------------------------------
    @property
    def guarantee_holds(self) -> bool:
        """Whether the run's (ε, δ) claim holds: every release was checked at start, none ran without one."""
        ...

    @property
    def unit(self) -> str:
        """What the run's ε hides: ``record`` or ``client`` (a client-level mechanism runs)."""
        ...

    population_size: int | None

    def epsilon(self) -> float:
        """ε spent so far (all releases) in the run's unit (inf for a run without a guarantee)."""
        ...

    def population_rounds(self) -> int:
        """The client-unit releases charged so far (rounds of a client-level mechanism)."""
        ...

    def record_epsilon(self) -> float:
        """ε for one record of any client (with a client-level mechanism, the better of the two analyses)."""
        ...

    def budgeted_epsilon(self) -> float:
        """ε spent so far by the releases the budget counts, maximum over clients."""
        ...

    def client_epsilon(self, client_id: int) -> float:
        """ε spent so far by one client (all releases; 0 for a client that never trained)."""
        ...

    # ---- start ----------------------------------------------------------------------------------
    def check_delta(self, train_sizes: Iterable[int]) -> None:
        """Refuse a δ that guarantees nothing (δ ≥ 1/n, n the smallest client's training set)."""
        ...

    def check_guarantee(self, releases: Sequence[DPRelease], declared: dict[str, str | None], net: nn.Module,
                        algorithm: str, model_problems: Sequence[str] = ()) -> None:
        """Refuse any configured release or declared upload field without a guarantee (or, with
        ``allow_non_private``, report ε as infinite)."""
        ...

    def open_ledger(self, rank: int = 0) -> None:
        """Open the ledger file (this process's ``rank``) and rebuild the ledgers from it."""
        ...

    # ---- planning -------------------------------------------------------------------------------
    def planned_rounds(self, num_clients: int, planned: PlannedEvents, start_round: int,
                       population: Sequence[tuple[str, DPEvent]] = ()) -> int | None:
        """The round count (from round 0) at which the budget is spent (None: no budget)."""
        ...

    def check_round(self, round_idx: int, client_ids: Sequence[int], planned: PlannedEvents,
                    population: Sequence[tuple[str, DPEvent]] = ()) -> None:
        """Refuse (``PrivacyBudgetError``) a round that would take a client (or the population) past the budget."""
        ...

    # ---- charging -------------------------------------------------------------------------------
    def charge_upload(self, round_idx: int, update: ClientUpdate) -> None:
        """Check an upload's fields are private, write its events to the ledger file, charge them."""
        ...

    def charge_received(self, updates: Sequence[ClientUpdate]) -> None:
        """Charge the round's uploads that other processes released (and wrote to their own files)."""
        ...

    def charge_release(self, client_id: int, events: Sequence[tuple[str, DPEvent]], *, round_idx: int) -> None:
        """Charge a one-off release made outside the uploads (written and fsynced first)."""
        ...

    def charge_population(self, round_idx: int, events: Sequence[tuple[str, DPEvent]]) -> None:
        """Charge a round's client-unit release to the population's ledger (written and fsynced first)."""
        ...

    def mark_non_private(self) -> None:
        """A release without a guarantee ran (allowed by ``allow_non_private``): ε is infinite from now on."""
        ...

    # ---- persistence ----------------------------------------------------------------------------
    def sync(self) -> None:
        """Make the ledger entries written so far durable (before any upload leaves the process)."""
        ...

    def migrate_checkpoint(self) -> None:
        """Write ledgers restored from a checkpoint older than ledger files into the ledger file."""
        ...

    def close(self) -> None:
        """Close the ledger file."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Every ledger's history (a copy: with a ledger file, the file is the source of truth)."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, unless the ledger file already holds (and covers) it."""
        ...


def find_accountant(callbacks: Iterable[Any]) -> PrivacyAccountant | None:
    """The run's privacy accountant among ``callbacks`` (None if it has none).

    The one place that finds it (``Federation.accountant`` calls it): a run has exactly one
    ledger of its releases, so a second accountant (e.g. added with ``--trainer.callbacks+=``)
    is refused, rather than letting each reader pick its own.

    Raises:
        ConfigError: more than one accountant.
    """
    found = [cb for cb in callbacks if getattr(cb, "is_privacy_accountant", False)]
    if len(found) > 1:
        raise ConfigError(f"trainer.callbacks has {len(found)} privacy accountants "
                          f"({', '.join(type(cb).__name__ for cb in found)}); a run has exactly one: "
                          f"remove all but one")
    return found[0] if found else None
