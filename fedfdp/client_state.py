"""Per-client algorithm state (control variates, gradient memory, personal models).

A :class:`ClientStateStore` maps ``client id → name → tensor``. Entries are created lazily the
first time a client needs them, so memory is spent only on clients that have state (a client
that never trained costs nothing), and the whole store is part of the algorithm's
``state_dict`` and therefore of every Lightning checkpoint. What a client keeps stays on the
client: the server's half of a round cannot read it (:mod:`fedfdp.privacy.channel`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fedfdp.privacy.channel import check_client_state_read


class ClientStateStore:
    """Lazily created per-client tensors with ``state_dict``/``load_state_dict``."""

    #: what it holds stays on the client: the server's half cannot read it, and the check that the
    #: clients' half leaves nothing on the algorithm leaves it out (:mod:`fedfdp.privacy.channel`)
    holds_client_state = True

    def __init__(self) -> None:
        self._state: dict[int, dict[str, Tensor]] = {}

    def has(self, client_id: int, name: str) -> bool:
        """Whether ``client_id`` already holds ``name``."""
        check_client_state_read(f"whether client {client_id} holds {name!r}")
        return name in self._state.get(client_id, {})

    def get(self, client_id: int, name: str, default: Callable[[], Tensor] | None = None) -> Tensor | None:
        """The stored tensor; if absent, ``default()`` is stored and returned (None: nothing stored)."""
        check_client_state_read(f"client {client_id}'s {name!r}")
        entry = self._state.get(client_id, {})
        if name in entry:
            return entry[name]
        if default is None:
            return None
        value = default()
        self.set(client_id, name, value)
        return value

    def set(self, client_id: int, name: str, value: Tensor) -> None:
        """Store a detached copy-free reference to ``value`` for ``client_id``."""
        self._state.setdefault(client_id, {})[name] = value.detach()

    def entry(self, client_id: int) -> dict[str, Tensor]:
        """Everything ``client_id`` holds, by name (empty when it holds nothing)."""
        check_client_state_read(f"client {client_id}'s state")
        return dict(self._state.get(client_id, {}))

    def set_entry(self, client_id: int, entry: dict[str, Tensor]) -> None:
        """Replace everything ``client_id`` holds with ``entry`` (empty: it holds nothing)."""
        if entry:
            self._state[client_id] = {name: value.detach() for name, value in entry.items()}
        else:
            self._state.pop(client_id, None)

    def clients(self) -> list[int]:
        """Client ids that hold any state."""
        check_client_state_read("which clients hold state")
        return sorted(self._state)

    def evaluation_groups(self, name: str, fallback: Tensor, num_clients: int) -> list[tuple[list[int], Tensor]]:
        """Each client holding ``name`` evaluated on it alone; the rest together on ``fallback``
        (``Algorithm.evaluation_groups`` of algorithms with per-client models)."""
        own = [c for c in self.clients() if c < num_clients and self.has(c, name)]
        groups: list[tuple[list[int], Tensor]] = [([c], self._state[c][name]) for c in own]
        rest = [c for c in range(num_clients) if c not in set(own)]
        return groups + ([(rest, fallback)] if rest else [])

    def num_bytes(self) -> int:
        """Memory held by the stored tensors."""
        return sum(t.numel() * t.element_size() for entry in self._state.values() for t in entry.values())

    def state_dict(self) -> dict[str, Any]:
        """``{client_id: {name: tensor}}`` (CPU copies, for checkpoints)."""
        return {cid: {k: v.detach().cpu().clone() for k, v in entry.items()} for cid, entry in self._state.items()}

    def load_state_dict(self, state: dict[Any, dict[str, Tensor]], device: torch.device | str | None = None) -> None:
        """Replace the store's content with ``state``."""
        self._state = {int(cid): {k: (v.to(device) if device is not None else v.clone()) for k, v in entry.items()}
                       for cid, entry in state.items()}
