"""The clients' half of :class:`fedfdp.Federation`: each sampled client's local update and its release.

A round's uploads come from :meth:`FederationClientWork.train_clients`: every client's local update
from the broadcast model (stacked into one engine pass over the union of the clients' batches where
the algorithm allows it, :mod:`fedfdp.stacked`), each inside its own mechanism trace
(:func:`fedfdp.privacy.mechanism.tracing`), with the proof that its charged DP events and private
fields came out of the mechanism (:meth:`FederationClientWork.check_mechanism`) before it is charged,
written and released. The server's half (aggregation, server step, logging) is
:meth:`fedfdp.Federation.training_step`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from fedfdp.client import ClientModule
from fedfdp.distributed import gather_updates, rank_and_world
from fedfdp.errors import PrivacyError
from fedfdp.interfaces import AlgorithmHooks, FederatedData
from fedfdp.privacy.accountant import PrivacyAccountant
from fedfdp.privacy.channel import changed_attribute, fingerprint
from fedfdp.privacy.mechanism import current_trace, tracing, verify_upload
from fedfdp.privacy.sampling import hand_over
from fedfdp.privacy.uploads import POST_PROCESSING, declared_upload_privacy
from fedfdp.seeding import RandomSource, make_generator
from fedfdp.stacked import StackedRound
from fedfdp.types import ClientData, ClientUpdate, RoundContext

logger = logging.getLogger(__name__)


class FederationClientWork:
    """The clients' half of :class:`fedfdp.Federation` (which sets every attribute declared here)."""

    client: ClientModule
    algorithm: AlgorithmHooks
    datamodule: FederatedData
    device: torch.device
    seed: int
    secure_rng: bool
    stacked_round: bool
    current_round: int
    _stacked: StackedRound
    _declared_uploads: dict[str, str | None] | None
    _channel_before: dict[str, Any] | None = None
    accountant: PrivacyAccountant | None

    def _call(self, hook: str, *args: Any) -> None:  # the federation's callback dispatch
        raise NotImplementedError

    def client_data(self, client_id: int) -> ClientData:
        """Client ``client_id``'s training split on this module's device."""
        x, y = self.datamodule.client_train(client_id, self.device)
        # handed over: the only data the mechanism draws a private step's sample from (fedfdp.privacy.sampling)
        return hand_over(ClientData(client_id=client_id, x=x.to(self.device), y=y.to(self.device)))

    def generator(self, *keys: int | str) -> RandomSource:
        """The random source of stream ``keys`` (seeded, or the CSPRNG with ``secure_rng``)."""
        return make_generator(self.seed, *keys, device=self.device, secure=self.secure_rng)

    def release_client_update(self, data: ClientData, update: ClientUpdate) -> None:
        """A client's upload is done: ``on_client_update`` with its local model still loaded in
        ``self.client``; the proof that its charges and private fields came out of the mechanism
        (:meth:`check_mechanism`); then ``on_client_release`` (charged, and on disk, before the
        upload leaves)."""
        self._call("on_client_update", self.client, data, update)
        self.check_mechanism(update)
        self.check_channel(update)
        self._call("on_client_release", update)

    def check_mechanism(self, update: ClientUpdate) -> None:
        """Refuse an upload whose charged DP events or private fields the mechanism did not produce.

        Runs inside the client's trace (:func:`fedfdp.privacy.mechanism.tracing`, opened around its
        local update), before anything is written or leaves. Only a run with an accountant claims
        privacy; with ``allow_non_private`` a mismatch makes ε infinite instead of stopping the run.

        Raises:
            PrivacyError: the upload charges releases the mechanism did not make, makes releases it
                does not charge, or carries a private field that is not a mechanism output.
        """
        accountant = self.accountant
        if accountant is None:
            return
        if self._declared_uploads is None:
            self._declared_uploads = declared_upload_privacy(self)
        trace = current_trace()
        problems = (["was not made inside a traced local update (Federation.train_client or a stacked round)"]
                    if trace is None or trace.client_id != update.client_id else
                    verify_upload(update, trace, self._declared_uploads, POST_PROCESSING))
        if not problems:
            return
        message = (f"round {self.current_round + 1}: client {update.client_id}'s upload {problems[0]}; it was not "
                   f"released")
        if not accountant.allow_non_private:
            raise PrivacyError(message)
        logger.warning("RDPAccounting.allow_non_private: %s. epsilon is reported as inf", message)
        accountant.mark_non_private()

    def check_channel(self, update: ClientUpdate) -> None:
        """Refuse an upload while the clients' half has left state on the algorithm that its server's
        half could read unreleased (:mod:`fedfdp.privacy.channel`): the algorithm's fingerprint
        taken when the round's clients' half started must still hold. Checked before each upload is
        released, so nothing is charged, written or aggregated.

        Raises:
            PrivacyError: one line naming the attribute (with ``allow_non_private``, ε is infinite).
        """
        before, accountant = self._channel_before, self.accountant
        if before is None or accountant is None:
            return
        name = changed_attribute(self.algorithm, before)
        if name is None:
            return
        message = (f"round {self.current_round + 1}: the clients' half of model.algorithm "
                   f"{type(self.algorithm).__name__} (local_update) changed its attribute {name!r}, which its "
                   f"server's half could read unreleased; keep per-client state in a "
                   f"fedfdp.client_state.ClientStateStore and send the server only the upload; client "
                   f"{update.client_id}'s upload was not released")
        if not accountant.allow_non_private:
            raise PrivacyError(message)
        logger.warning("RDPAccounting.allow_non_private: %s. epsilon is reported as inf", message)
        accountant.mark_non_private()
        self._channel_before = fingerprint(self.algorithm)  # reported once

    def train_client(self, client_id: int, context: RoundContext, global_params: torch.Tensor) -> ClientUpdate:
        """One client's local update from ``global_params`` and its release (charged before it returns).

        The client's own random stream ``generator("client", t, i)``; ``on_client_update`` and
        ``on_client_release`` run before the upload is returned. A Flower ClientApp runs exactly
        this on its node (:mod:`fedfdp.flower.node`).
        """
        with tracing(client_id, self.algorithm.public_server_state):
            self.client.load_start_model(self.algorithm.client_start_params(client_id, global_params, context))
            data = self.client_data(client_id)
            generator = self.generator("client", self.current_round, client_id)
            with self.client.local_optimizer_for(client_id):  # fresh, or the client's kept state
                update = self.algorithm.local_update(self.client, data, context, generator)
            self.release_client_update(data, update)
        return update

    def train_clients(self, context: RoundContext, client_ids: list[int],
                      global_params: torch.Tensor) -> list[ClientUpdate]:
        """The round's uploads, in the order of ``client_ids``: local updates and releases of every client.

        Stacked (one engine pass over the union of the clients' batches) where it applies, else
        client by client; with several processes each trains its share and the uploads are
        exchanged. A Flower deployment (:class:`fedfdp.flower.strategy.FlowerFederation`) sends
        the clients' work to their nodes instead; a client may then be missing from the result.
        """
        rank, world = rank_and_world()
        # what the server's half may see of the algorithm when the clients' half starts (check_channel)
        self._channel_before = fingerprint(self.algorithm) if self.accountant is not None else None
        stacked = self._stacked.plan(self, context) if self.stacked_round else None
        local: list[ClientUpdate] = []
        if stacked is not None:  # one engine pass over the union of the clients' batches (one process)
            local = self._stacked.run(self, stacked, client_ids, global_params, context)
        else:
            for cid in client_ids[rank::world]:  # several processes: client k goes to rank k mod world
                local.append(self.train_client(cid, context, global_params))
        self._call("on_uploads_final", local)  # the releases are durable before any upload leaves this process
        # one exchange per round; afterwards every process holds every upload in client order and
        # runs the same accounting, aggregation and server step
        order = {cid: k for k, cid in enumerate(client_ids)}
        return sorted(gather_updates(local), key=lambda u: order[u.client_id])
