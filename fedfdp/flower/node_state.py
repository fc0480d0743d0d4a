"""A deployed client's own algorithm state, kept on its node between rounds and across restarts.

Algorithms that keep per-client state between rounds (SCAFFOLD's ``c_i``, FedDyn's gradient
memory, Ditto's and local-only training's personal models) hold it, in a deployment, on the node
that owns the client: :meth:`~fedfdp.algorithms.base.Algorithm.export_client_state` after each
round the client trains, :meth:`~fedfdp.algorithms.base.Algorithm.import_client_state` before the
next. The state never crosses to the server (only what the algorithm uploads, which is checked
against its ``upload_privacy``).

Two copies, one content:

* the node's ``context.state`` (Flower keeps it for the run during the SuperNode's life), read
  first since it costs no disk read;
* a file beside the client's privacy ledger, ``client_state-<run key>-p<partition>.pt``, written
  atomically (temporary file, fsync, rename) after every trained round, so a SuperNode restart
  continues where it stopped.

Each copy holds the state after each of the client's last :data:`KEEP` trained rounds. The
server names the round to continue from (the last round whose upload it received: a round the
node trained but the server never heard of, or one replayed after a resume, is not continued
from); a node without that round's state refuses the round with one line rather than train from
a wrong state.
"""

from __future__ import annotations

import io
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedfdp.errors import FedFDPError

__all__ = ["KEEP", "ClientStateError", "NodeStateFile", "state_path"]

#: States kept per client: the last trained rounds (a resume replays at most the rounds after the
#: last checkpoint; checkpointing every round needs 2).
KEEP = 4
_FORMAT = 1


class ClientStateError(FedFDPError):
    """The node does not hold the client state the server's round continues from."""


def state_path(directory: Path, run_key: str, partition: int) -> Path:
    """The state file of client ``partition`` in run ``run_key`` under ``directory``."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", run_key):
        raise ValueError(f"run key {run_key!r} must be letters, digits, '_', '.' or '-'")
    return Path(directory) / f"client_state-{run_key}-p{partition}.pt"


def _to_bytes(history: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(history, buffer)
    return buffer.getvalue()


def _from_bytes(raw: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(raw), weights_only=True)


class NodeStateFile:
    """Client ``partition``'s state history in run ``run_key``: ``{round: {name: tensor}}``.

    Args:
        directory: where the node keeps its files (its ``ledger-dir``).
        run_key: the fedfdp run (from the server; kept across resumes).
        partition: the client.
        cache: the node's ``context.state`` (a Flower ``RecordDict``) or None.
    """

    def __init__(self, directory: Path, run_key: str, partition: int, cache: Any = None) -> None:
        self.path = state_path(directory, run_key, partition)
        self.run_key, self.partition, self.cache = run_key, partition, cache
        self._cache_key = f"fedfdp.client_state.{run_key}.p{partition}"

    def _read(self) -> dict[int, dict[str, Tensor]]:
        """The kept states by round: the cache's if it has them, else the file's (empty: none)."""
        raw: bytes | None = None
        if self.cache is not None and self._cache_key in self.cache.array_records:
            raw = self.cache.array_records[self._cache_key].to_numpy_ndarrays()[0].tobytes()
        elif self.path.is_file():
            raw = self.path.read_bytes()
        if raw is None:
            return {}
        history = _from_bytes(raw)
        if history.get("format") != _FORMAT or history.get("run_key") != self.run_key \
                or history.get("partition") != self.partition:
            raise ClientStateError(f"{self.path} is not client {self.partition}'s state of run {self.run_key} "
                                   f"(format {history.get('format')}, run {history.get('run_key')}, partition "
                                   f"{history.get('partition')})")
        return {int(r): dict(s) for r, s in history["rounds"].items()}

    def rounds(self) -> list[int]:
        """The rounds (0-based) whose state is kept."""
        return sorted(self._read())

    def load(self, client_round: int) -> dict[str, Tensor]:
        """The state after round ``client_round`` (-1: before the client's first round, empty).

        Raises:
            ClientStateError: the node does not hold it (state files lost, or older than kept).
        """
        if client_round < 0:
            return {}
        history = self._read()
        if client_round not in history:
            kept = sorted(history)
            raise ClientStateError(
                f"client {self.partition}: the server continues from its state after round {client_round + 1}, but "
                f"this node holds {'rounds ' + str([r + 1 for r in kept]) if kept else 'no state'} of run "
                f"{self.run_key} ({self.path}); restore that file or start a new run")
        return history[client_round]

    def save(self, round_idx: int, state: dict[str, Tensor]) -> None:
        """Keep ``state`` as the state after round ``round_idx`` (the last :data:`KEEP` rounds stay)."""
        history = {r: s for r, s in self._read().items() if r < round_idx}
        history[round_idx] = {k: v.detach().cpu().clone() for k, v in state.items()}
        kept = dict(sorted(history.items())[-KEEP:])
        raw = _to_bytes({"format": _FORMAT, "run_key": self.run_key, "partition": self.partition, "rounds": kept})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        if self.cache is not None:
            from flwr.app import ArrayRecord

            self.cache[self._cache_key] = ArrayRecord([np.frombuffer(raw, dtype=np.uint8).copy()])
