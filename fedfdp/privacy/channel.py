"""The only channel from a client to the server is its upload, in a simulation too.

In a simulation one algorithm object serves both halves of a round: its clients' half
(``local_update``, a stacked step's halves, ``client_start_params``) sees each client's records,
and its server's half (``configure_round``, ``aggregate``, ``on_round_end``) sees only what the
mechanism released. Anything the clients' half leaves on the object the server's half could read
unreleased (a subclass that stores a client's mean label on ``self`` in ``local_update`` and
writes it into the global model in ``aggregate`` publishes it exactly, while every upload passes
its receipts). Two checks keep the halves apart, as a deployment's processes are:

* :func:`fingerprint` / :func:`changed_attribute`: the federation takes the algorithm's
  fingerprint before its clients' half runs and compares it after; an attribute the clients'
  half wrote (set, replaced, or changed in place: a tensor's in-place version, an array's bytes,
  a list, dict or nested object of fedfdp's) refuses the round before anything is aggregated.
  Per-client state belongs in a :class:`fedfdp.client_state.ClientStateStore`, which
  the fingerprint leaves out because of the second check;
* :func:`server_half`: while the server's half runs, a read of a client-state store raises
  (:func:`check_client_state_read`): what a client keeps stays on the client;
* the server's half is handed the uploads without their simulation diagnostics (raw losses,
  realised batch sizes: :class:`fedfdp.types.ClientUpdate`'s ``diagnostics``), which reach the
  logs only (:meth:`fedfdp.Federation.training_step`).

What this does not see: state the clients' half writes outside the algorithm object (a module
global, the client module, the data module). A Flower deployment runs the halves in separate
processes (:mod:`fedfdp.flower`); there, only the upload crosses.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np
from torch import Tensor, nn

from fedfdp.errors import PrivacyError

__all__ = ["changed_attribute", "check_client_state_read", "fingerprint", "server_half"]

_SERVER_HALF: ContextVar[str | None] = ContextVar("fedfdp_server_half", default=None)
_DEPTH = 4


@contextmanager
def server_half(hook: str) -> Iterator[None]:
    """The server's half of a round runs within the block (``hook``: its name, for the error)."""
    token = _SERVER_HALF.set(hook)
    try:
        yield
    finally:
        _SERVER_HALF.reset(token)


def check_client_state_read(what: str) -> None:
    """Refuse a read of client state (``what``) while the server's half runs.

    Raises:
        PrivacyError: one line naming the hook and what it read.
    """
    hook = _SERVER_HALF.get()
    if hook is not None:
        raise PrivacyError(f"model.algorithm's server half ({hook}) read {what}, which a client keeps and never "
                           f"uploads; the server may use only the uploads, the broadcast and its own state")


def _skipped(value: Any) -> bool:
    # a ClientStateStore says so (``holds_client_state``): its reads are guarded by server_half instead
    return (getattr(type(value), "holds_client_state", False) or isinstance(value, nn.Module)
            or callable(value) and not isinstance(value, type))


def _print(value: Any, depth: int) -> Any:
    """A comparable summary of ``value`` that changes when ``value`` is set anew or changed in place."""
    if isinstance(value, Tensor):
        return ("tensor", id(value), value._version)  # torch's in-place version counter
    if isinstance(value, np.ndarray):
        return ("array", id(value), hashlib.blake2b(np.ascontiguousarray(value).tobytes(), digest_size=16).digest())
    if isinstance(value, (float, complex)):
        return repr(value)  # NaN equals itself as text
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return value
    if depth <= 0:
        return ("object", id(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, id(value), tuple(_print(v, depth - 1) for v in value))
    if isinstance(value, dict):
        return ("dict", id(value), tuple((repr(k), _print(v, depth - 1)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return ("set", id(value), len(value), hash(frozenset(map(repr, value))))
    if _skipped(value):
        return ("skipped", id(value))
    if type(value).__module__.split(".")[0] == "fedfdp" and hasattr(value, "__dict__"):
        return ("object", id(value), tuple((k, _print(v, depth - 1)) for k, v in vars(value).items()))
    return ("object", id(value))


def fingerprint(algorithm: Any) -> dict[str, Any]:
    """``{attribute: summary}`` of the algorithm's attributes, client-state stores and modules left out."""
    return {name: _print(value, _DEPTH) for name, value in vars(algorithm).items() if not _skipped(value)}


def changed_attribute(algorithm: Any, before: dict[str, Any]) -> str | None:
    """The first attribute of ``algorithm`` that is new, gone or changed since ``before`` (None: none)."""
    after = fingerprint(algorithm)
    for name in [*before, *(n for n in after if n not in before)]:
        if before.get(name, _MISSING) != after.get(name, _MISSING):
            return name
    return None


_MISSING = object()
