"""The algorithm interface: a server half and a client half, each hook with a FedAvg default.

Adding an algorithm means subclassing :class:`Algorithm` (usually one of the shipped ones) in
one module and writing one config; the federation loop (:mod:`fedfdp.federation`) never changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor

from fedfdp.aggregate import weighted_mean
from fedfdp.errors import ConfigError
from fedfdp.privacy.accounting import DPEvent
from fedfdp.privacy.mechanism import checked_one_off_release
from fedfdp.privacy.validation import DPRelease
from fedfdp.seeding import RandomSource
from fedfdp.types import ClientData, ClientUpdate, LocalStep, RoundContext, StackedStepSpec

if TYPE_CHECKING:
    from fedfdp.client import ClientModule
    from fedfdp.interfaces import FederationView


class Algorithm:
    """Base federated algorithm (its defaults are FedAvg's server: the p_i-weighted mean).

    Class attributes:
        required_callbacks: the callbacks the run must have, by the class path a config names them
            with (``"callbacks.NoisyLossReporting"``). The federation refuses to start without an
            instance of each or of a subclass (e.g. an algorithm that releases losses under DP needs
            the callback that privatises and accounts them); named, not imported: the algorithms
            import no callback (:func:`fedfdp.interfaces.is_instance_of`).
        supports_distributed: whether the algorithm may run with several processes
            (:mod:`fedfdp.distributed`): true when everything it keeps between rounds is computed
            from the (all-gathered) uploads on the server side, false when ``local_update`` keeps
            per-client state that would stay on the process that happened to train the client.
        deploy_refusal: why the algorithm cannot run with its clients on Flower SuperNodes
            (:mod:`fedfdp.flower`), or None: it can. A deployed client keeps its own state
            (:meth:`export_client_state`) on its node and receives the server state its local
            update reads (:meth:`public_server_state`) with each round.
    """

    required_callbacks: ClassVar[tuple[str, ...]] = ()
    supports_distributed: ClassVar[bool] = False
    deploy_refusal: ClassVar[str | None] = None

    def setup(self, federation: FederationView) -> None:
        """Validate against the data and prepare state; called once when fitting starts."""

    # ---- server half ------------------------------------------------------------------------
    def configure_round(self, round_idx: int) -> RoundContext:
        """What the server broadcasts besides ``w_t`` (nothing by default)."""
        return RoundContext(round=round_idx)

    def client_start_params(self, client_id: int, global_params: Tensor, context: RoundContext) -> Tensor:
        """The model client ``client_id`` starts its local update from (``w_t`` by default).

        Clustered algorithms return the client's cluster model here.
        """
        return global_params

    def evaluation_groups(self, global_params: Tensor, num_clients: int) -> list[tuple[list[int], Tensor]]:
        """Which model evaluates which clients: ``[(client_ids, params), ...]``.

        Default: the global model for every client. Clustered or personalised algorithms return
        one group per cluster model (or per client).
        """
        return [(list(range(num_clients)), global_params)]

    def on_fit_start(self, federation: FederationView) -> None:
        """Called once training starts, after a checkpoint (if any) and the privacy ledger are restored
        and before the rounds are planned: the place for a one-off private release that the
        rounds' budget must account for (``federation.accountant.compose``)."""

    # ---- a one-off release of every client before training (on_fit_start) -------------------
    def needs_fit_start_release(self) -> bool:
        """Whether each client must release something once before the rounds are planned (and
        has not yet: a checkpoint may hold it). Default: no."""
        return False

    def fit_start_events(self, client_id: int) -> list[tuple[str, DPEvent]]:
        """The DP events of client ``client_id``'s one-off release, charged before it is computed."""
        return []

    def fit_start_release(self, federation: FederationView, client_id: int) -> dict[str, Tensor]:
        """Client ``client_id``'s one-off release, computed where its data is (after the charge)."""
        return {}

    def take_fit_start_releases(self, releases: dict[int, dict[str, Tensor]]) -> None:
        """The server keeps every client's one-off release (``{client: fit_start_release}``)."""

    def release_at_fit_start(self, federation: FederationView) -> None:
        """Every client's one-off release in a simulation: charge, compute, keep (a Flower
        deployment asks each node for its client's instead)."""
        if not self.needs_fit_start_release():
            return
        accountant = federation.accountant
        if accountant is None:
            raise ConfigError(f"{type(self).__name__} makes a private release at fit start and needs "
                              f"callbacks.RDPAccounting")
        releases = {}
        for cid in range(federation.num_clients):
            events = self.fit_start_events(cid)
            accountant.compose(cid, events, round_idx=federation.start_round)
            releases[cid] = checked_one_off_release(self, federation, cid, events)  # the mechanism's output only
        self.take_fit_start_releases(releases)

    def evaluation_logit_offsets(self) -> Tensor | None:
        """Per-client offsets ``b_i`` added to the evaluation model's logits (``(num_clients, num_classes)``).

        Client i predicts ``argmax_c f(x)_c + b_{i,c}`` and is scored on that (loss included).
        None (the default): the model's logits as they are. An algorithm that returns offsets
        computed from a client's data must have released them privately (and charged them).
        """
        return None

    def aggregate(self, global_params: Tensor, updates: list[ClientUpdate], context: RoundContext) -> Tensor:
        """New global model from the uploads: ``Σ_i p_i w_{t+1}^i`` with ``p_i ∝ |D_i|``."""
        return weighted_mean([u.params for u in updates], [u.num_examples for u in updates])

    def on_round_end(self, updates: list[ClientUpdate], context: RoundContext) -> dict[str, float]:
        """Update server state after aggregation; return scalars to log."""
        return {}

    # ---- client half ------------------------------------------------------------------------
    def local_step(self, context: RoundContext) -> LocalStep | None:
        """This round's local training as steps, written once (:class:`~fedfdp.types.LocalStep`):
        :meth:`local_update` runs it per client (:func:`run_local_step`) and a stacked round or a
        sweep runs the same steps in lockstep (:meth:`stackable_step`). None (the default): the
        algorithm writes :meth:`local_update` itself and its rounds run per client."""
        return None

    def local_update(self, client: ClientModule, data: ClientData, context: RoundContext,
                     generator: RandomSource) -> ClientUpdate:
        """Train ``client`` (holding ``w_t``) on ``data``; return the upload: :meth:`local_step` run
        for this client alone, where the algorithm writes one."""
        step = self.local_step(context)
        if step is None:
            raise NotImplementedError(f"{type(self).__name__} writes neither local_step nor local_update")
        return run_local_step(step, client, data, generator)

    def stackable_step(self, context: RoundContext) -> StackedStepSpec | None:
        """This round's :meth:`local_step` for a stacked round or a sweep to run in lockstep, if they may.

        None when the algorithm writes no step, when the step is per client only (``stackable``
        False), or when a subclass replaced :meth:`local_update` below the class that wrote the
        step: its own loop must then run, per client (extension code is not assumed to keep the two
        equal). Lockstep runs exactly what :func:`run_local_step` runs, so the two paths agree.
        """
        if _replaced_below(type(self), "local_update", "local_step"):
            return None
        step = self.local_step(context)
        return step if step is not None and step.stackable else None

    def planned_dp_events(self, client_id: int, dataset_size: int) -> list[tuple[str, DPEvent]]:
        """The DP events of one round of local training (empty for non-private algorithms)."""
        return []

    def dp_releases(self) -> list[DPRelease]:
        """Every kind of private release the algorithm makes, with its σ and clip bound.

        :class:`callbacks.RDPAccounting` refuses the run at start if any has σ = 0 or an
        unbounded clip. Empty for non-private algorithms.
        """
        return []

    def upload_privacy(self) -> dict[str, str | None]:
        """How each field of this algorithm's uploads is private: ``{field: kind}``.

        Fields are ``"params"`` (the local model), ``"reported_loss"`` and ``"extras.<key>"``
        (:class:`~fedfdp.types.ClientUpdate`). ``kind`` is the DP event kind that privatises the
        field (a :class:`DPRelease` of that ``kind`` must be declared, and each upload must carry
        an event of it), :data:`~fedfdp.privacy.uploads.POST_PROCESSING` for a field computed only
        from charged releases and public values, or ``None``: not private. Fail-closed: the
        default declares the model update not private, and a field an upload carries that no
        component declares is not private either (:mod:`fedfdp.privacy.uploads`).
        """
        return {"params": None}

    #: Whether every model that evaluation reports (:meth:`evaluation_groups`, with
    #: :meth:`evaluation_logit_offsets`) is a function of this algorithm's charged releases and
    #: public values only, so that the run's ε covers the models it evaluates. True here: the
    #: default hooks evaluate the released global model as it is. False for models trained on raw
    #: data and kept on the client (e.g. DP-Ditto's personal models with ``private_personal: false``).
    #: Fail-closed (:meth:`covers_evaluated_models`): a class that overrides an evaluation hook
    #: must declare this itself; an inherited declaration does not cover the new hook.
    evaluated_models_covered: ClassVar[bool] = True

    #: The models the server forms from the released uploads, as the privacy ledger names them
    #: (every event's ``models``): ``global`` here; ``clusters`` (clustered DPFL), ``own`` (each
    #: client's own model, local training).
    released_models: ClassVar[str] = "global"
    #: The models kept and evaluated on the clients besides them (``personal``, ``fine-tuned``,
    #: ``prior-corrected``), None when there are none: covered by the run's ε only where
    #: :meth:`covers_evaluated_models` says so.
    kept_models: ClassVar[str | None] = None

    #: The hooks that decide which model, with which logit offsets, evaluates each client.
    EVALUATION_HOOKS: ClassVar[tuple[str, ...]] = ("evaluation_groups", "evaluation_logit_offsets")

    def covers_evaluated_models(self) -> bool:
        """Whether the run's ε covers every model it evaluates (``summary.json``'s
        ``evaluated_models_private``, together with ``dp_valid``).

        ``evaluated_models_covered`` counts only where it is declared on the instance, or on the
        class that defines the most derived evaluation hook (or a subclass of it): a subclass that
        overrides :meth:`evaluation_groups` or :meth:`evaluation_logit_offsets` and says nothing
        evaluates models that no declaration has vouched for, so the answer is False.
        """
        if "evaluated_models_covered" in vars(self):  # set per run, e.g. from a constructor flag
            return bool(self.evaluated_models_covered)
        return self.class_covers_evaluated_models()

    def covered_models(self) -> str:
        """The models the run's ε covers, as every privacy-ledger event names them: ``released_models``,
        with ``+kept_models`` where the models kept on the clients are covered too (e.g.
        ``global+personal`` for DP-Ditto with private personal steps, ``global`` without them)."""
        if self.kept_models is None or not self.covers_evaluated_models():
            return self.released_models
        return f"{self.released_models}+{self.kept_models}"

    @classmethod
    def class_covers_evaluated_models(cls) -> bool:
        """:meth:`covers_evaluated_models` from the class's declarations alone (no instance flag)."""
        mro = cls.__mro__
        hook_owner = min(i for i, klass in enumerate(mro) if any(h in vars(klass) for h in cls.EVALUATION_HOOKS))
        declarer = next(i for i, klass in enumerate(mro) if "evaluated_models_covered" in vars(klass))
        return declarer <= hook_owner and bool(vars(mro[declarer])["evaluated_models_covered"])

    # ---- deployment: what a client keeps on its node, what the server sends it ----------------
    def export_client_state(self, client_id: int) -> dict[str, Tensor]:
        """What client ``client_id`` keeps between rounds and never uploads (control variates,
        gradient memory, personal models): its entries in every :class:`ClientStateStore` the
        algorithm holds, as ``{"<attribute>/<name>": tensor}``. A deployed node saves it after each
        round the client trains (:mod:`fedfdp.flower.node_state`) and restores it with
        :meth:`import_client_state` before the next."""
        from fedfdp.algorithms.client_state import ClientStateStore

        return {f"{attr}/{name}": tensor for attr, store in vars(self).items() if isinstance(store, ClientStateStore)
                for name, tensor in store.entry(client_id).items()}

    def import_client_state(self, client_id: int, state: dict[str, Tensor]) -> None:
        """Restore :meth:`export_client_state` (an empty ``state``: a client that has not trained yet)."""
        from fedfdp.algorithms.client_state import ClientStateStore

        stores = {attr: store for attr, store in vars(self).items() if isinstance(store, ClientStateStore)}
        entries: dict[str, dict[str, Tensor]] = {attr: {} for attr in stores}
        for key, tensor in state.items():
            attr, _, name = key.partition("/")
            if attr not in stores:
                raise ValueError(f"client state entry {key!r} names no client-state store of "
                                 f"{type(self).__name__} (stores: {sorted(stores)})")
            entries[attr][name] = tensor
        for attr, store in stores.items():
            store.set_entry(client_id, entries[attr])

    def public_server_state(self) -> dict[str, Any]:
        """The server state a client's local update reads besides ``w_t`` and the round's broadcast
        (e.g. SCAFFOLD's control variate ``c``), sent to deployed clients with each round. It must
        be public: computed from charged releases and public values only. Default: nothing."""
        return {}

    def load_public_server_state(self, state: dict[str, Any]) -> None:
        """Take :meth:`public_server_state` on a client's node."""

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Server state to checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""


def run_local_step(step: LocalStep, client: ClientModule, data: ClientData, generator: RandomSource) -> ClientUpdate:
    """One client's round of ``step`` alone (the per-client scheduler of a :class:`~fedfdp.types.LocalStep`).

    ``start`` (its model set on ``client``), then the client's ``steps_of(data)`` steps, each on
    ``batch(data, generator)``, then the upload: ``update_steps`` of every step's output for a
    lockstep step, else ``update`` of the one output. The stacked engine (:mod:`fedfdp.stacked`)
    makes the same calls in the same order per client, interleaving the clients.
    """
    if step.start is not None:
        client.set_flat_params(step.start(client, data, generator))
    outputs = [client.training_step(step.batch(data, generator)) for _ in range(step.steps_of(data))]
    if step.lockstep:
        assert step.update_steps is not None, "a lockstep LocalStep needs update_steps"
        return step.update_steps(client, data, outputs)
    return step.update(client, data, outputs[0])


def after_upload(step: LocalStep, hook: Callable[[ClientUpdate], ClientUpdate]) -> LocalStep:
    """``step`` with ``hook`` applied to every client's upload once its steps are taken, on every
    scheduler (e.g. keeping the model as the client's own)."""
    one, every = step.update, step.update_steps
    return replace(step, update=lambda client, data, output: hook(one(client, data, output)),
                   update_steps=None if every is None else lambda client, data, outputs: hook(every(client, data, outputs)))


def _replaced_below(cls: type, method: str, written: str) -> bool:
    """Whether the class that defines ``method`` last in ``cls``'s MRO comes before (is more derived
    than) the one that defines ``written`` last: ``method`` was replaced below where ``written`` is."""
    def owner(name: str) -> int:
        return next(i for i, klass in enumerate(cls.__mro__) if name in vars(klass))
    return owner(method) < owner(written)
