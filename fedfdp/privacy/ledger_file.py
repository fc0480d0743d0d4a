"""A crash-proof privacy ledger: one JSON line per release, fsynced before any upload leaves the process.

The accountant's in-memory state (:class:`fedfdp.privacy.accounting.PrivacyLedger`) lives in
model checkpoints, which are written every few rounds; a crash between two checkpoints would
forget the releases made since the last one, and a resumed (or restarted) run would release
them again uncounted. This file is the accountant's source of truth instead:

* every DP event is appended (``write`` + ``flush``) when the client's upload is final
  (:meth:`fedfdp.privacy.run_accountant.RunAccountant.charge_upload`, from the federation's
  ``on_client_release``) and made durable (``os.fsync``, once for the round's uploads) *before*
  any upload leaves the process to be exchanged or aggregated
  (:meth:`~fedfdp.privacy.run_accountant.RunAccountant.sync`, from ``on_uploads_final``), so what
  the server can have seen is always on disk; a one-off release is fsynced at once;
* a run (fresh, resumed from any checkpoint, or restarted without one) rebuilds its ledgers
  from the file, so rounds that are replayed after a crash are charged again, never forgotten.

Format: one JSON object per line,
``{"round": t, "client": i, "kind": "model"|"loss"|..., "sigma": σ, "q": q, "steps": n, "unit": u, "models": m}``:
``unit`` is what the event hides, ``record`` (one record of client i) or ``client`` (a whole client;
such an event is charged to the whole population, ``"client": -1``); ``models`` names the models
whose guarantee it is part of (:meth:`fedfdp.algorithms.Algorithm.covered_models`: ``global``,
``clusters``, ``own``, ``global+personal``, ...; absent where the run did not say, e.g. lines
migrated from a checkpoint). Files written before ``unit`` was on every line read as ``record``
unless ``"client": -1``.
A line cut short by a crash during the write was never fsynced, hence never released: it is
dropped when the file is opened again. Several processes (:mod:`fedfdp.distributed`) each
append to their own file (``<stem>.rank<r>.jsonl``); reading takes the union.

Written by hand: neither Opacus nor Lightning offers a durable, append-only accountant log.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedfdp.errors import DataError
from fedfdp.privacy.accounting import DPEvent
from fedfdp.types import POPULATION

logger = logging.getLogger(__name__)

__all__ = ["LedgerEntry", "LedgerFile", "checkpoint_entries"]


@dataclass(frozen=True)
class LedgerEntry:
    """One charged release: ``event`` of kind ``kind`` made by ``client`` in round ``round``.

    ``run`` names the run that made it where one ledger outlives runs (a Flower node's ledger,
    :mod:`fedfdp.flower.node_ledger`); None (not written) in a run directory's ledger. ``models``:
    the models whose guarantee the event is part of (None: not said). Its privacy unit follows from
    ``client`` (:attr:`unit`).
    """

    round: int
    client: int
    kind: str
    event: DPEvent
    run: str | None = None
    models: str | None = None

    @property
    def unit(self) -> str:
        """``client`` for an event charged to the population (client-level DP), else ``record``."""
        return "client" if self.client == POPULATION else "record"

    def to_json(self) -> str:
        """The entry as one JSON line (without the newline)."""
        e = self.event
        record: dict[str, Any] = {"round": self.round, "client": self.client, "kind": self.kind,
                                  "sigma": float(e.noise_multiplier), "q": float(e.sample_rate), "steps": int(e.steps)}
        record["unit"] = self.unit
        if self.models is not None:
            record["models"] = self.models
        if self.run is not None:
            record["run"] = self.run
        return json.dumps(record)

    @classmethod
    def from_json(cls, line: str) -> LedgerEntry:
        """Parse one line written by :meth:`to_json` (raises ``ValueError``/``KeyError`` if malformed)."""
        d: dict[str, Any] = json.loads(line)
        return cls(round=int(d["round"]), client=int(d["client"]), kind=str(d["kind"]),
                   event=DPEvent(noise_multiplier=float(d["sigma"]), sample_rate=float(d["q"]),
                                 steps=int(d["steps"])),
                   run=None if d.get("run") is None else str(d["run"]),
                   models=None if d.get("models") is None else str(d["models"]))


class LedgerFile:
    """Append-only, fsynced ledger at ``path`` (rank ``rank`` writes ``<stem>.rank<rank><suffix>``).

    Args:
        path: the ledger of rank 0, e.g. ``runs/x/privacy_ledger.jsonl``.
        rank: this process's rank (other ranks write beside it).
    """

    def __init__(self, path: str | os.PathLike[str], rank: int = 0) -> None:
        self.path = Path(path)
        self.own_path = self.path if rank == 0 else self.path.with_name(
            f"{self.path.stem}.rank{rank}{self.path.suffix}")
        self._handle: Any = None
        self._unsynced = False

    def files(self) -> list[Path]:
        """Every rank's ledger file that exists (rank 0's first)."""
        pattern = f"{self.path.stem}.rank*{self.path.suffix}"
        others = sorted(p for p in self.path.parent.glob(pattern) if p != self.path)
        return ([self.path] if self.path.exists() else []) + others

    def read(self) -> list[LedgerEntry]:
        """Every complete entry of every rank's file.

        Raises:
            DataError: a complete line (one that ends in a newline) is not a valid entry: the
                ledger was edited or corrupted, and ε cannot be trusted.
        """
        entries: list[LedgerEntry] = []
        for file in self.files():
            try:
                text = file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:  # a folder, unreadable, not text
                raise DataError(f"privacy ledger {file} cannot be read ({type(err).__name__}: {err}); it is the record "
                                f"of what this run released: restore it or start a new run_dir") from err
            lines = text.split("\n")
            for number, line in enumerate(lines[:-1], start=1):  # the last piece has no newline
                if not line.strip():
                    continue
                try:
                    entries.append(LedgerEntry.from_json(line))
                except (ValueError, KeyError, TypeError) as err:
                    raise DataError(f"privacy ledger {file} line {number} is corrupt ({err}); it is the "
                                    f"record of what this run released: restore it or start a new run_dir") from err
            if lines[-1].strip():
                logger.warning("privacy ledger %s ends in an incomplete line (a crash during its write, before "
                               "that release left the client): ignored", file)
        return entries

    def append(self, entries: list[LedgerEntry], *, sync: bool = True) -> None:
        """Write ``entries``; with ``sync`` fsync them (they are on disk when this returns), else
        they are written and :meth:`sync` makes them durable (one fsync for a round's releases)."""
        if not entries:
            return
        if self._handle is None:
            self._open()
        self._handle.write("".join(e.to_json() + "\n" for e in entries))
        self._handle.flush()
        self._unsynced = True
        if sync:
            self.sync()

    def sync(self) -> None:
        """Make every entry written so far durable (fsync; nothing to do when none is pending)."""
        if self._handle is not None and self._unsynced:
            os.fsync(self._handle.fileno())
        self._unsynced = False

    def _open(self) -> None:
        self.own_path.parent.mkdir(parents=True, exist_ok=True)
        if self.own_path.exists():  # drop a line cut short by a crash, so appends start on a new line
            data = self.own_path.read_bytes()
            if data and not data.endswith(b"\n"):
                with open(self.own_path, "r+b") as f:
                    f.truncate(data.rfind(b"\n") + 1)
        self._handle = open(self.own_path, "a", encoding="utf-8")  # noqa: SIM115 (held for the run)
        _fsync_dir(self.own_path.parent)

    def close(self) -> None:
        """Make the entries durable and close the file (appending again reopens it)."""
        if self._handle is not None:
            self.sync()
            self._handle.close()
            self._handle = None


def _fsync_dir(folder: Path) -> None:
    """Make a newly created file's directory entry durable (POSIX; a no-op where unsupported)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def checkpoint_entries(events: dict[int, list[DPEvent]], counted: dict[int, list[DPEvent]]) -> list[LedgerEntry]:
    """Entries (round -1: before ledger files existed) for a checkpoint's ledgers: per client every
    event, ``model`` when the budget counted it (``counted``), else ``loss``."""
    from fedfdp.types import LOSS_RELEASE, MODEL_RELEASE

    entries = []
    for cid, history in events.items():
        budget = list(counted.get(cid, []))
        for event in history:
            kind = MODEL_RELEASE if event in budget else LOSS_RELEASE
            if event in budget:
                budget.remove(event)
            entries.append(LedgerEntry(round=-1, client=cid, kind=kind, event=event))
    return entries
