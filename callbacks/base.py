"""Federation hooks on top of Lightning's ``Callback``.

A :class:`FederationCallback` is an ordinary Lightning callback (it lives in ``trainer.callbacks``,
gets ``setup``/``state_dict``/checkpoint hooks, and is configured with ``class_path``) with the
federation hooks of :class:`fedfdp.interfaces.FederationHooks`, which the federation loop calls in
a fixed phase order each round::

    setup_federation (once, at start)
    on_round_start → (per client: local update → on_client_update → on_client_release)
    → on_uploads_final → on_before_aggregate → aggregation → on_round_end → [evaluation → on_evaluate]

The order is set by the phases, not by the list order of ``trainer.callbacks``: every
``on_client_update`` (where releases are privatised) runs before that client's
``on_client_release`` (where they are written to the privacy ledger), and ``on_uploads_final``
(where the ledger is made durable, one fsync for the round) runs before any upload leaves its
process: before the uploads are exchanged, before ``on_before_aggregate`` and before the server
reads anything.

The hooks are defined in the core (:mod:`fedfdp.interfaces`), which never imports this package.
"""

from __future__ import annotations

from lightning.pytorch import Callback

from fedfdp.interfaces import FederationHooks
from fedfdp.privacy.accountant import run_accountant_of

__all__ = ["FederationCallback", "run_accountant_of"]


class FederationCallback(FederationHooks, Callback):
    """Base class of callbacks with federation hooks; every hook is a no-op by default
    (:class:`fedfdp.interfaces.FederationHooks`).

    With several processes (:mod:`fedfdp.distributed`) ``on_client_update`` runs only on the
    process that trained the client, every other hook on every process with all uploads. State
    kept across rounds must therefore be updated from the uploads (``on_before_aggregate``), not
    in ``on_client_update``; a callback that cannot do that sets ``supports_distributed = False``.
    """
