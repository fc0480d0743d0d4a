"""Federation hooks on top of Lightning's ``Callback``.

A :class:`FederationCallback` is an ordinary Lightning callback (it lives in ``trainer.callbacks``,
gets ``setup``/``state_dict``/checkpoint hooks, and is configured with ``class_path``) with extra
hooks that the federation loop calls in a fixed phase order each round::

    setup_federation (once, at start)
    on_round_start → (per client: local update → on_client_update → on_client_release)
    → on_uploads_final → on_before_aggregate → aggregation → on_round_end → [evaluation → on_evaluate]

The order is set by the phases, not by the list order of ``trainer.callbacks``: every
``on_client_update`` (where releases are privatised) runs before that client's
``on_client_release`` (where they are written to the privacy ledger), and ``on_uploads_final``
(where the ledger is made durable, one fsync for the round) runs before any upload leaves its
process: before the uploads are exchanged, before ``on_before_aggregate`` and before the server
reads anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from lightning.pytorch import Callback, Trainer

if TYPE_CHECKING:
    from fedfdp.client import ClientModule
    from fedfdp.federation import Federation
    from fedfdp.metrics import EvaluationResult
    from fedfdp.privacy.accounting import DPEvent
    from fedfdp.privacy.validation import DPRelease
    from fedfdp.types import ClientData, ClientUpdate, RoundContext


def find_accountant(callbacks: list[Any]) -> Any:
    """The run's privacy accountant among ``callbacks`` (None if it has none).

    The one place that finds it (``Federation.accountant`` calls it): a run has exactly one
    ledger of its releases, so a second accountant (e.g. added with ``--trainer.callbacks+=``)
    is refused, rather than letting each reader pick its own.

    Raises:
        ConfigError: more than one accountant.
    """
    from fedfdp.errors import ConfigError  # runtime import: fedfdp imports this module

    found = [cb for cb in callbacks if getattr(cb, "is_privacy_accountant", False)]
    if len(found) > 1:
        raise ConfigError(f"trainer.callbacks has {len(found)} privacy accountants "
                          f"({', '.join(type(cb).__name__ for cb in found)}); a run has exactly one: "
                          f"remove all but one")
    return found[0] if found else None


class FederationCallback(Callback):
    """Base class of callbacks with federation hooks; every hook is a no-op by default.

    With several processes (:mod:`fedfdp.distributed`) ``on_client_update`` runs only on the
    process that trained the client, every other hook on every process with all uploads. State
    kept across rounds must therefore be updated from the uploads (``on_before_aggregate``), not
    in ``on_client_update``; a callback that cannot do that sets ``supports_distributed = False``.
    """

    supports_distributed: ClassVar[bool] = True
    is_privacy_accountant: ClassVar[bool] = False
    """True for the callback that charges every DP event (:class:`callbacks.RDPAccounting`); a run
    has at most one (:func:`find_accountant`)."""

    def max_rounds(self, trainer: Trainer, federation: Federation) -> int | None:
        """An upper bound on the number of rounds this callback allows (None: no bound)."""
        return None

    def planned_dp_events(self, federation: Federation, client_id: int) -> list[tuple[str, DPEvent]]:
        """DP events this callback adds to one round of ``client_id`` (for budget planning)."""
        return []

    def dp_releases(self, federation: Federation) -> list[DPRelease]:
        """The private releases this callback makes (σ and C; checked at start by the accountant)."""
        return []

    def upload_privacy(self, federation: Federation) -> dict[str, str | None]:
        """How each upload field this callback fills is private (``{"reported_loss": "loss"}``; ``None``:
        not private). See :meth:`fedfdp.algorithms.Algorithm.upload_privacy`; a field it fills that is
        declared nowhere counts as not private."""
        return {}

    def setup_federation(self, trainer: Trainer, federation: Federation) -> None:
        """Called once at start, after the algorithm's setup and before the rounds are planned."""

    def on_round_start(self, trainer: Trainer, federation: Federation, context: RoundContext,
                       client_ids: list[int]) -> None:
        """Called before any client of the round trains."""

    def on_client_update(self, trainer: Trainer, federation: Federation, client: ClientModule,
                         data: ClientData, update: ClientUpdate) -> None:
        """Called after one client's local update, with the local model still loaded in ``client``."""

    def on_client_release(self, trainer: Trainer, federation: Federation, update: ClientUpdate) -> None:
        """Called once a client's upload is final (after every ``on_client_update``), before it leaves.

        Runs on the process that trained the client; the place to make releases durable.
        """

    def on_uploads_final(self, trainer: Trainer, federation: Federation, updates: list[ClientUpdate]) -> None:
        """Called once this process's uploads of the round are released (``updates``: its own), before
        any of them is exchanged with other processes or read by the server: the place to make
        the round's releases durable."""

    def on_before_aggregate(self, trainer: Trainer, federation: Federation,
                            updates: list[ClientUpdate]) -> None:
        """Called once all clients of the round have uploaded, before the server aggregates."""

    def on_round_end(self, trainer: Trainer, federation: Federation, context: RoundContext,
                     updates: list[ClientUpdate], metrics: dict[str, float]) -> None:
        """Called after aggregation; add scalars to ``metrics`` to have them logged this round."""

    def on_evaluate(self, trainer: Trainer, federation: Federation, result: EvaluationResult,
                    metrics: dict[str, Any]) -> None:
        """Called after the global model was evaluated (every ``eval_every`` rounds and at the end)."""
