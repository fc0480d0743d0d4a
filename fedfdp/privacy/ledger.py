"""A run's privacy ledger: every client's charged releases, in memory and in the durable ledger file.

Per client two :class:`~fedfdp.privacy.accounting.PrivacyLedger` (Opacus' ``RDPAccountant``
histories): every release, and the releases the budget counts (``accounting_mode``: all of
them under ``theorem2``, the model releases only under ``model_only``). With a ``path`` every
charge is first appended to the ledger file (:mod:`fedfdp.privacy.ledger_file`), which is then
the source of truth: :meth:`RunLedger.open` rebuilds the ledgers from it, and a checkpoint's
copy of them is only checked against it (:meth:`RunLedger.load_state_dict`), or migrated into it
when the checkpoint predates ledger files (:meth:`RunLedger.migrate`).

ε is cached per ledger and refreshed only when the ledger changes: a round costs O(sampled
clients), not O(clients that ever trained), RDP-to-ε conversions (~0.5 ms each).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from fedfdp.errors import PrivacyError
from fedfdp.privacy.accounting import Accountant, DPEvent, PrivacyLedger, epsilon_of, uncovered_steps
from fedfdp.privacy.ledger_file import LedgerEntry, LedgerFile, checkpoint_entries
from fedfdp.types import CLIENT_RELEASE, MODEL_RELEASE, POPULATION

logger = logging.getLogger(__name__)

__all__ = ["AccountingMode", "RunLedger", "counted_events"]

#: Which releases count against the budget: ``theorem2`` (model steps and loss releases, FedFDP
#: Theorem 2) or ``model_only`` (the model steps only: the authors' code).
AccountingMode = Literal["theorem2", "model_only"]


def counted_events(events: Iterable[tuple[str, DPEvent]], mode: AccountingMode) -> list[DPEvent]:
    """The events of ``(kind, event)`` pairs that ``mode`` counts against the budget."""
    if mode == "model_only":
        return [e for kind, e in events if kind in (MODEL_RELEASE, CLIENT_RELEASE)]
    return [e for _, e in events]


class RunLedger:
    """Every client's charged releases (all, and those the budget counts), with an optional ledger file.

    Args:
        orders: RDP orders of every ε.
        delta: δ of every ε.
        mode: which releases the budget counts (:data:`AccountingMode`).
        accountant_kind: ``rdp`` or ``prv`` (:mod:`fedfdp.privacy.accounting`).
        path: the ledger file (rank 0's); None keeps the ledgers in memory (and checkpoints) only.
    """

    def __init__(self, *, orders: Sequence[float], delta: float, mode: AccountingMode,
                 accountant_kind: Accountant, path: str | None = None) -> None:
        self.orders = tuple(orders)
        self.delta = delta
        self.mode = mode
        self.accountant_kind = accountant_kind
        self.path = path
        self.file: LedgerFile | None = None
        self.pending_migration = False  # checkpoint-only ledgers to write to the file (:meth:`migrate`)
        self.ledgers: dict[int, PrivacyLedger] = {}           # every release
        self.budget_ledgers: dict[int, PrivacyLedger] = {}    # releases counted by ``mode``
        self._spent: dict[int, float] = {}
        self._budget_spent: dict[int, float] = {}
        self.read_rounds: list[int] = []  # the round of every entry the file held when opened
        #: the models every entry's guarantee covers (``Algorithm.covered_models``), set when the run starts
        self.models: str | None = None

    # ---- in memory ------------------------------------------------------------------------------
    def counted(self, events: Iterable[tuple[str, DPEvent]]) -> list[DPEvent]:
        """The events the budget counts (:func:`counted_events` under this ledger's mode)."""
        return counted_events(events, self.mode)

    def _ledger(self, store: dict[int, PrivacyLedger], client_id: int) -> PrivacyLedger:
        if client_id not in store:  # created lazily: memory only for clients that trained
            store[client_id] = PrivacyLedger(orders=self.orders, accountant_kind=self.accountant_kind)
        return store[client_id]

    def budget_ledger(self, client_id: int) -> PrivacyLedger:
        """Client ``client_id``'s ledger of the releases the budget counts (created empty if none)."""
        return self._ledger(self.budget_ledgers, client_id)

    def spent_budget_events(self, client_id: int) -> tuple[DPEvent, ...]:
        """The budget-counted events client ``client_id`` has spent (empty for a client that never trained)."""
        return self.budget_ledgers[client_id].events if client_id in self.budget_ledgers else ()

    def record(self, client_id: int, events: Sequence[tuple[str, DPEvent]]) -> None:
        """Charge ``events`` to the in-memory ledgers of ``client_id`` (not to the file; ε not refreshed)."""
        for _, event in events:
            self._ledger(self.ledgers, client_id).record(event)
        for event in self.counted(events):
            self._ledger(self.budget_ledgers, client_id).record(event)

    def refresh(self, client_ids: Iterable[int]) -> None:
        """Recompute the cached ε of the ledgers of ``client_ids`` (after they changed)."""
        for cid in client_ids:
            if cid in self.ledgers:
                self._spent[cid] = self.ledgers[cid].epsilon(self.delta)
            if cid in self.budget_ledgers:
                self._budget_spent[cid] = self.budget_ledgers[cid].epsilon(self.delta)

    def reset(self) -> None:
        """Forget every in-memory charge (the file, if any, is untouched)."""
        self.ledgers.clear()
        self.budget_ledgers.clear()
        self._spent.clear()
        self._budget_spent.clear()

    def epsilon(self) -> float:
        """ε spent so far (all releases of the record unit), maximum over clients."""
        return max((eps for cid, eps in self._spent.items() if cid != POPULATION), default=0.0)

    def budgeted_epsilon(self) -> float:
        """ε spent so far by the budget-counted releases of the record unit, maximum over clients."""
        return max((eps for cid, eps in self._budget_spent.items() if cid != POPULATION), default=0.0)

    def has_record_events(self) -> bool:
        """Whether any client's own ledger holds an event (a record-level release was charged)."""
        return any(cid != POPULATION and led.events for cid, led in self.ledgers.items())

    def population_epsilon(self, budgeted: bool = False) -> float:
        """ε of the client unit so far (the population's ledger, :data:`~fedfdp.types.POPULATION`):
        all its releases, or with ``budgeted`` those the budget counts."""
        return (self._budget_spent if budgeted else self._spent).get(POPULATION, 0.0)

    def client_epsilon(self, client_id: int) -> float:
        """ε spent so far by one client (all releases; 0 for a client that never trained)."""
        return self._spent.get(client_id, 0.0)

    def client_budgeted_epsilon(self, client_id: int) -> float:
        """ε spent so far by one client's budget-counted releases (0 for a client that never trained)."""
        return self._budget_spent.get(client_id, 0.0)

    def epsilon_rdp(self, population: bool = False) -> float:
        """ε spent so far (all releases) by the RDP accountant, maximum over clients (for comparison), or
        with ``population`` of the client unit."""
        if population:
            led = self.ledgers.get(POPULATION)
            return epsilon_of(led.events, self.delta, self.orders) if led is not None else 0.0
        return max((epsilon_of(led.events, self.delta, self.orders) for cid, led in self.ledgers.items()
                    if cid != POPULATION), default=0.0)

    # ---- the ledger file ------------------------------------------------------------------------
    def open(self, rank: int = 0) -> None:
        """Open the ledger file (this process's ``rank``) and rebuild every in-memory ledger from it.

        A no-op without a ``path``.
        """
        if self.path is None:
            return
        if self.file is not None:
            self.file.close()
        self.file = LedgerFile(self.path, rank=rank)
        entries = self.file.read()
        self.read_rounds = [entry.round for entry in entries]
        self.reset()
        by_client: dict[int, list[tuple[str, DPEvent]]] = {}
        for entry in entries:
            by_client.setdefault(entry.client, []).append((entry.kind, entry.event))
        for cid, events in by_client.items():
            self.record(cid, events)
        self.refresh(by_client)
        if entries:
            logger.info("privacy ledger %s: %d earlier releases of %d clients charged (epsilon %.4f so far)",
                        self.path, len(entries), len(by_client), self.epsilon())

    def releases_since(self, round_idx: int) -> int:
        """How many entries the file held when opened that were made in round ``round_idx`` or later.

        Resumed from a checkpoint at round ``round_idx``, these are the releases a session made after
        its last checkpoint before it was cut: they stay charged, and the rounds they belong to run
        (and release) again.
        """
        return sum(1 for r in self.read_rounds if r >= round_idx)

    def charge(self, round_idx: int, client_id: int, events: Sequence[tuple[str, DPEvent]], *,
               sync: bool = True) -> None:
        """Write ``events`` of client ``client_id`` to the ledger file (fsynced, unless ``sync`` is
        false: then :meth:`sync` makes them durable), then charge them and refresh its ε."""
        if self.file is not None:
            self.file.append([LedgerEntry(round=round_idx, client=client_id, kind=kind, event=event,
                                          models=self.models) for kind, event in events], sync=sync)
        self.record(client_id, events)
        self.refresh((client_id,))

    def sync(self) -> None:
        """Make every entry written so far durable (fsync)."""
        if self.file is not None:
            self.file.sync()

    def close(self) -> None:
        """Make the entries durable and close the file."""
        if self.file is not None:
            self.file.close()

    # ---- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every ledger's history: ``{"ledgers": {client: state}, "budget_ledgers": {client: state}}``."""
        return {"ledgers": {cid: led.state_dict() for cid, led in self.ledgers.items()},
                "budget_ledgers": {cid: led.state_dict() for cid, led in self.budget_ledgers.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the ledgers from a checkpoint, unless the ledger file already holds them.

        The file holds every release, including those after the checkpoint, so it wins (it must
        cover the checkpoint's charges: :meth:`check_covers`). A checkpoint written before ledger
        files existed (an empty file) is migrated into it (:meth:`migrate`).
        """
        if self.file is not None and self.ledgers:
            self.check_covers(state_dict["ledgers"])
            return
        self.reset()
        for key, store in (("ledgers", self.ledgers), ("budget_ledgers", self.budget_ledgers)):
            for cid, led_state in state_dict[key].items():
                self._ledger(store, int(cid)).load_state_dict(led_state)
        self.refresh(set(self.ledgers) | set(self.budget_ledgers))
        self.pending_migration = self.file is not None and bool(self.ledgers)

    def check_covers(self, checkpoint_ledgers: dict[Any, dict[str, Any]]) -> None:
        """Refuse a ledger file that lacks releases the checkpoint recorded (truncated, or another run's).

        The file is the single source of truth and a checkpoint only a copy of it at one round, so
        every charge in the checkpoint must be in the file; resuming from a file that forgot some
        would report less ε than was spent.
        """
        for cid, led_state in checkpoint_ledgers.items():
            recorded = [DPEvent(noise_multiplier=s, sample_rate=q, steps=n) for s, q, n in led_state["history"]]
            in_file = self.ledgers[int(cid)].events if int(cid) in self.ledgers else ()
            missing = uncovered_steps(recorded, in_file)
            if missing:
                raise PrivacyError(f"privacy ledger {self.path} lacks {missing} mechanism steps of client {cid} "
                                   "that the checkpoint recorded (truncated, or another run's ledger): refusing to "
                                   "resume with spent budget forgotten")

    def migrate(self) -> None:
        """Write checkpoint-only ledgers to the ledger file (round -1: before ledger files existed), if
        a checkpoint left any (:meth:`load_state_dict`)."""
        if not self.pending_migration:
            return
        assert self.file is not None
        self.pending_migration = False
        entries = checkpoint_entries({c: list(led.events) for c, led in self.ledgers.items()},
                                     {c: list(led.events) for c, led in self.budget_ledgers.items()})
        self.file.append(entries)
        logger.info("privacy ledger %s: migrated %d checkpoint entries", self.path, len(entries))

