"""A client's own privacy ledger on its node: every release ever made from its data, durable.

In a Flower deployment the server can no longer be trusted to count for a client: the client
keeps its own ledger, in a file on its node keyed by its partition
(``<ledger-dir>/partition-<id>.jsonl``; Flower's ``context.state`` does not survive a SuperNode
restart and the node then gets a new id). The file is the same append-only, fsynced JSON-lines
ledger as a run directory's (:mod:`fedfdp.privacy.ledger_file`), each line tagged with the Flower
run that made the release, and it outlives runs: the client's ε is the composition of *every*
release it made, in every run of every server.

Per round the ClientApp

1. asks :meth:`NodeLedger.refusal` whether the round's planned releases would take the client
   past its target ε, and refuses to train (telling the server why) when they would;
2. trains and privatises, then charges the releases with :meth:`NodeLedger.charge` (written and
   fsynced) *before* the reply leaves the node (:class:`NodeLedgerCallback`, the node's
   ``on_client_release``).

A release that never happened (the node died before charging) is never charged; a release that
was charged but whose reply was lost is counted, which errs on the safe side. The node counts
every release against its target, whatever the run's ``accounting_mode``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from callbacks.base import FederationCallback
from fedfdp.errors import ConfigError
from fedfdp.privacy.accounting import PAPER_ORDERS, Accountant, DPEvent, PrivacyLedger
from fedfdp.privacy.ledger_file import LedgerEntry, LedgerFile
from fedfdp.types import ClientUpdate

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from fedfdp.federation import Federation

logger = logging.getLogger(__name__)

__all__ = ["NodeLedger", "NodeLedgerCallback", "ledger_path"]


def ledger_path(directory: str | Path, partition_id: int) -> Path:
    """The ledger file of partition ``partition_id`` in ``directory``."""
    return Path(directory).expanduser() / f"partition-{int(partition_id)}.jsonl"


class NodeLedger:
    """The privacy ledger of the client that holds partition ``partition_id`` on this node.

    Args:
        directory: where the node keeps its ledgers (node-config ``ledger-dir``).
        partition_id: the client's partition (its client id in the federation).
        target_epsilon: the client's budget; None accounts without refusing.
        delta: δ of the client's (ε, δ) guarantee.
        orders: RDP orders of the accountant.
        accountant: ``rdp`` or ``prv`` (:mod:`fedfdp.privacy.accounting`).
    """

    def __init__(self, directory: str | Path, partition_id: int, *, target_epsilon: float | None,
                 delta: float = 1e-5, orders: Sequence[float] = PAPER_ORDERS, accountant: Accountant = "rdp") -> None:
        if target_epsilon is not None and not (math.isfinite(target_epsilon) and target_epsilon > 0):
            raise ConfigError(f"node-config target-epsilon must be a finite number > 0, got {target_epsilon}")
        self.partition_id = int(partition_id)
        self.target_epsilon = target_epsilon
        self.delta = delta
        self.orders = tuple(orders)
        self.accountant: Accountant = accountant
        self.path = ledger_path(directory, partition_id)
        self._file = LedgerFile(self.path)
        self.entries: list[LedgerEntry] = []
        self._ledger = PrivacyLedger(orders=self.orders, accountant_kind=accountant)
        for entry in self._file.read():
            if entry.client != self.partition_id:
                raise ConfigError(f"privacy ledger {self.path} holds releases of client {entry.client}, not of "
                                  f"partition {self.partition_id}: give each partition its own ledger-dir file")
            self._add(entry)

    def _add(self, entry: LedgerEntry) -> None:
        self.entries.append(entry)
        self._ledger.record(entry.event)

    def epsilon(self) -> float:
        """ε of every release this client ever made (all runs)."""
        return self._ledger.epsilon(self.delta)

    def run_epsilon(self, run: str) -> float:
        """ε of the releases of one run (for comparison with a simulation of that run)."""
        ledger = PrivacyLedger(orders=self.orders, accountant_kind=self.accountant)
        for entry in self.entries:
            if entry.run == run:
                ledger.record(entry.event)
        return ledger.epsilon(self.delta)

    def refusal(self, planned: Sequence[tuple[str, DPEvent]]) -> str | None:
        """Why the client refuses a round whose releases are ``planned`` (None: it may train).

        Refused when the composition of every earlier release and this round's would exceed
        the target ε.
        """
        if self.target_epsilon is None or not planned:
            return None
        projected = self._ledger.projected_epsilon([event for _, event in planned], self.delta)
        if projected <= self.target_epsilon:
            return None
        return (f"client {self.partition_id} refuses: this round would take its epsilon to {projected:.4f}, over its "
                f"target {self.target_epsilon} (spent {self.epsilon():.4f} in {len(self.entries)} releases, "
                f"ledger {self.path})")

    def charge(self, round_idx: int, events: Sequence[tuple[str, DPEvent]], run: str | None, *,
               models: str | None = None) -> None:
        """Append the releases of one upload to the ledger file and fsync it, then count them
        (``models``: the models their guarantee covers, ``Algorithm.covered_models``)."""
        entries = [LedgerEntry(round=int(round_idx), client=self.partition_id, kind=kind, event=event, run=run,
                               models=models) for kind, event in events]
        self._file.append(entries)
        for entry in entries:
            self._add(entry)

    def close(self) -> None:
        """Close the ledger file."""
        self._file.close()


class NodeLedgerCallback(FederationCallback):
    """On the node, charges each upload's releases to the client's :class:`NodeLedger` before it leaves.

    Takes the place that :class:`callbacks.RDPAccounting` has in a simulation
    (``on_client_release``, after every ``on_client_update`` has privatised the upload).

    Args:
        ledger: the client's ledger.
        run: the Flower run id written with each entry.
    """

    def __init__(self, ledger: NodeLedger, run: str | None) -> None:
        self.ledger = ledger
        self.run = run

    def on_client_release(self, trainer: Trainer, federation: Federation, update: ClientUpdate) -> None:
        """Write the upload's DP events (fsynced) before the reply is returned."""
        if update.client_id != self.ledger.partition_id:
            raise RuntimeError(f"node of partition {self.ledger.partition_id} asked to release client {update.client_id}")
        self.ledger.charge(federation.current_round, update.dp_events, self.run,
                           models=federation.algorithm.covered_models())
