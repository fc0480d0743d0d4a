"""What the core's parts see of the federation, of its data and of its callbacks.

The core (:mod:`fedfdp.federation`, :mod:`fedfdp.client`, :mod:`fedfdp.evaluation`,
:mod:`fedfdp.stacked`, :mod:`fedfdp.types`, :mod:`fedfdp.algorithms`, :mod:`fedfdp.privacy`)
imports neither ``callbacks`` nor ``datamodules``, and no module of it imports one that imports
it back. The parts below the federation (the algorithms, the stacked round, the planning) see it
through :class:`FederationView`; the federation sees its data through :class:`FederatedData`
(implemented by ``datamodules.FederatedDataModule``) and its callbacks through
:class:`FederationHooks` (the base of ``callbacks.FederationCallback``). ``tests/project/test_imports.py``
keeps it so.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch
    from lightning.pytorch import Trainer
    from torch import Tensor, nn

    from fedfdp.client import ClientModule
    from fedfdp.metrics import EvaluationResult
    from fedfdp.privacy.accountant import PrivacyAccountant
    from fedfdp.privacy.accounting import DPEvent
    from fedfdp.privacy.validation import DPRelease
    from fedfdp.seeding import RandomSource
    from fedfdp.types import ClientData, ClientUpdate, RoundContext, StackedStepSpec

__all__ = ["FEDERATED_DATA_MEMBERS", "AlgorithmHooks", "FederatedData", "FederationHooks", "FederationView",
           "is_federated_data", "is_instance_of"]


class FederatedData(Protocol):
    """A federated datamodule as the core reads it (``datamodules.FederatedDataModule``).

    Attributes:
        num_clients: N.
        num_classes: the number of labels.
        train_sizes: ``|D_i|`` per client (after ``setup``).
    """

    num_clients: int
    num_classes: int
    train_sizes: np.ndarray

    @property
    def has_validation(self) -> bool:
        """Whether a validation split is held out of the training splits."""
        ...

    def client_train(self, cid: int, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
        """Client ``cid``'s training split ``(x, y)`` (on ``device``)."""
        ...

    def pooled_raw(self, split: Literal["train", "test", "val"]) -> tuple[Tensor, Tensor, Tensor,
                                                                        Callable[[Tensor], Tensor]]:
        """Every client's ``split`` in one array: ``(x, y, client ids, normalize)``."""
        ...


#: The members a datamodule must have to be a :class:`FederatedData` (:func:`is_federated_data`).
FEDERATED_DATA_MEMBERS = ("num_clients", "num_classes", "train_sizes", "has_validation", "client_train",
                          "pooled_raw")


def is_federated_data(datamodule: object) -> bool:
    """Whether ``datamodule``'s class has every member of :class:`FederatedData` (no property is run)."""
    missing = object()
    return all(inspect.getattr_static(datamodule, name, missing) is not missing for name in FEDERATED_DATA_MEMBERS)


def is_instance_of(obj: object, class_path: str) -> bool:
    """Whether ``obj``'s class, or one of its bases, is ``class_path`` as a config names it
    (``"callbacks.NoisyLossReporting"``: class ``NoisyLossReporting`` of package ``callbacks`` or of
    any of its modules): ``isinstance`` by name, without importing the class (the core names the
    callbacks an algorithm needs, ``Algorithm.required_callbacks``, and imports none)."""
    package, _, name = class_path.rpartition(".")
    return any(klass.__qualname__ == name and (klass.__module__ == package or klass.__module__.startswith(package + "."))
               for klass in type(obj).__mro__)


class AlgorithmHooks(Protocol):
    """What the core's modules call of the run's algorithm through the federation
    (:class:`fedfdp.algorithms.Algorithm` has every one)."""

    def upload_privacy(self) -> dict[str, str | None]:
        """How each field of the uploads is private."""
        ...

    def stackable_step(self, context: RoundContext) -> StackedStepSpec | None:
        """This round's local update as one private step per client, if it is one."""
        ...

    def client_start_params(self, client_id: int, global_params: Tensor, context: RoundContext) -> Tensor:
        """The model client ``client_id`` starts its local update from."""
        ...


class FederationView(Protocol):
    """The federation (:class:`fedfdp.Federation`) as the algorithms, the stacked round, the planning
    and the privacy checks use it."""

    client: ClientModule
    algorithm: AlgorithmHooks
    global_model: nn.Module
    datamodule: FederatedData
    clients_per_round: int | None
    num_rounds: int | None
    total_rounds: int
    start_round: int
    current_round: int
    seed: int
    ema_decay: float | None
    server_optimizer: Callable[..., torch.optim.Optimizer]

    @property
    def device(self) -> torch.device:
        """Where the run's tensors live."""
        ...

    @property
    def num_clients(self) -> int:
        """N."""
        ...

    @property
    def accountant(self) -> PrivacyAccountant | None:
        """The run's privacy accountant (None for a run without one)."""
        ...

    def generator(self, *keys: int | str) -> RandomSource:
        """The random source of stream ``keys``."""
        ...

    def client_data(self, client_id: int) -> ClientData:
        """Client ``client_id``'s training split on the run's device."""
        ...

    def planned_dp_events(self, client_id: int) -> list[tuple[str, DPEvent]]:
        """Every DP event one round of ``client_id`` will charge (algorithm and callbacks)."""
        ...

    def federation_callbacks(self) -> list[FederationHooks]:
        """The callbacks with federation hooks."""
        ...

    def release_client_update(self, data: ClientData, update: ClientUpdate) -> None:
        """A client's upload is done: its callbacks' hooks, the mechanism's proof, its charge."""
        ...


class FederationHooks:
    """The federation hooks every federation callback has; each is a no-op by default.

    ``callbacks.FederationCallback`` is this and a Lightning ``Callback``. The federation loop calls
    the hooks in a fixed phase order each round::

        setup_federation (once, at start)
        on_round_start → (per client: local update → on_client_update → on_client_release)
        → on_uploads_final → on_before_aggregate → aggregation → on_round_end → [evaluation → on_evaluate]

    With several processes (:mod:`fedfdp.distributed`) ``on_client_update`` runs only on the
    process that trained the client, every other hook on every process with all uploads. State
    kept across rounds must therefore be updated from the uploads (``on_before_aggregate``), not
    in ``on_client_update``; a callback that cannot do that sets ``supports_distributed = False``.
    """

    supports_distributed: ClassVar[bool] = True
    def provided_accountant(self) -> Any:
        """The privacy accountant this callback hands the run (:class:`callbacks.RDPAccounting`: itself),
        or None; a run has at most one (:func:`fedfdp.privacy.accountant.run_accountant_of`)."""
        return None

    def max_rounds(self, trainer: Trainer, federation: FederationView) -> int | None:
        """An upper bound on the number of rounds this callback allows (None: no bound)."""
        return None

    def planned_dp_events(self, federation: FederationView, client_id: int) -> list[tuple[str, DPEvent]]:
        """DP events this callback adds to one round of ``client_id`` (for budget planning)."""
        return []

    def dp_releases(self, federation: FederationView) -> list[DPRelease]:
        """The private releases this callback makes (σ and C; checked at start by the accountant)."""
        return []

    def upload_privacy(self, federation: FederationView) -> dict[str, str | None]:
        """How each upload field this callback fills is private (``{"reported_loss": "loss"}``; ``None``:
        not private). See :meth:`fedfdp.algorithms.Algorithm.upload_privacy`; a field it fills that is
        declared nowhere counts as not private."""
        return {}

    def setup_federation(self, trainer: Trainer, federation: FederationView) -> None:
        """Called once at start, after the algorithm's setup and before the rounds are planned."""

    def on_round_start(self, trainer: Trainer, federation: FederationView, context: RoundContext,
                       client_ids: list[int]) -> None:
        """Called before any client of the round trains."""

    def on_client_update(self, trainer: Trainer, federation: FederationView, client: ClientModule,
                         data: ClientData, update: ClientUpdate) -> None:
        """Called after one client's local update, with the local model still loaded in ``client``."""

    def on_client_release(self, trainer: Trainer, federation: FederationView, update: ClientUpdate) -> None:
        """Called once a client's upload is final (after every ``on_client_update``), before it leaves.

        Runs on the process that trained the client; the place to make releases durable.
        """

    def on_uploads_final(self, trainer: Trainer, federation: FederationView, updates: list[ClientUpdate]) -> None:
        """Called once this process's uploads of the round are released (``updates``: its own), before
        any of them is exchanged with other processes or read by the server: the place to make
        the round's releases durable."""

    def on_before_aggregate(self, trainer: Trainer, federation: FederationView,
                            updates: list[ClientUpdate]) -> None:
        """Called once all clients of the round have uploaded, before the server aggregates."""

    def canary_uploads(self, trainer: Trainer, federation: FederationView, round_idx: int,
                       global_params: Tensor) -> list[ClientUpdate]:
        """Uploads of audit canaries that take part in this round's release, beside the clients' (an
        empirical privacy audit, ``callbacks.CanaryClientAudit``); only a mechanism that releases the
        round's aggregate (client-level DP) takes them, after ``on_before_aggregate``. None by default."""
        return []

    def on_round_end(self, trainer: Trainer, federation: FederationView, context: RoundContext,
                     updates: list[ClientUpdate], metrics: dict[str, float]) -> None:
        """Called after aggregation; add scalars to ``metrics`` to have them logged this round."""

    def summary_entries(self, federation: FederationView) -> dict[str, Any]:
        """Entries this callback adds to ``summary.json`` (e.g. an audit's ``audit``); none by default."""
        return {}

    def on_evaluate(self, trainer: Trainer, federation: FederationView, result: EvaluationResult,
                    metrics: dict[str, Any]) -> None:
        """Called after the global model was evaluated (every ``eval_every`` rounds and at the end)."""

