"""The server's strategy in a Flower deployment: the simulation's federation, with its clients on SuperNodes.

:class:`FlowerFederation` is :class:`fedfdp.Federation`, driven by the same Lightning ``Trainer``
as a simulation: the algorithm samples and configures the clients, aggregates and steps the
server optimizer; the federation callbacks adapt the loss bounds (``NoisyLossReporting``),
keep the server's view of every client's ε (``RDPAccounting``), write ``metrics.csv``,
``summary.json``, ``report.md``, checkpoints and W&B. Two things change:

* :meth:`FlowerFederation.train_clients` sends each sampled client's round to the SuperNode
  serving its partition now (:class:`~fedfdp.flower.roster.NodeRoster`: a node restarted for the
  same partition, under a new node id, takes its client back at the next message round) and
  reads back the uploads. A client that refuses (its own budget), fails, does not answer within
  the round timeout or has no live node is logged and left out of the round; the round proceeds
  with the others (a round with no upload at all stops the run). Every left-out client and round
  is kept (:attr:`FlowerFederation.participation`): ``summary.json`` lists them
  (``missing_clients``) and its status is then not plain ``completed``. Each received upload is
  checked and charged to the server's view of the client's ε as in a simulation
  (``on_client_release``: written to the run directory's ``privacy_ledger.jsonl``).
* :meth:`FlowerFederation._evaluate_splits` asks every node to evaluate the run's model on its
  own splits; the server never holds client data (:class:`RemoteClients` stands in for the
  datamodule: sizes only). A client whose node does not answer has no numbers (NaN): the pooled
  figures cover the clients that answered, and ``summary.json`` names them (``evaluated_clients``).

The server's ε is what the clients declared with their uploads; each client's own ledger, on its
node, is the one that counts (:mod:`fedfdp.flower.node_ledger`). With client-level DP
(:class:`fedfdp.privacy.ClientLevelDP`) the server is the trusted aggregator: it draws the Poisson
cohort over the N partitions itself (the nodes it asks are those sampled; a sampled node that does
not answer only lowers the inclusion rate, which the accountant's q bounds), clips each received
update, adds the noise and charges the population's ledger in its run directory, which holds the
run's client-level ε; the nodes' ledgers hold their record-level releases, if any.
"""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any

import torch
from flwr.app import Message
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from torch.nn.utils import parameters_to_vector

from callbacks.base import FederationCallback
from callbacks.cluster_metrics import ClusterMetrics
from callbacks.mia import MembershipInferenceAudit
from callbacks.sia import SourceInferenceAudit
from fedfdp.algorithms.base import Algorithm
from fedfdp.client import trainable
from fedfdp.errors import ConfigError, FedFDPError
from fedfdp.federation import Federation
from fedfdp.flower import protocol
from fedfdp.flower.protocol import NodeDescription, Refusal
from fedfdp.flower.remote import RemoteClients
from fedfdp.flower.roster import NodeRoster, describe_nodes, exchange
from fedfdp.participation import Participation, rounds_phrase
from fedfdp.types import ClientUpdate, RoundContext

logger = logging.getLogger(__name__)

__all__ = ["FlowerFederation", "RemoteClients", "check_deployable", "exchange"]

#: Callbacks that read every client's data on the server (audits of a simulation).
SIMULATION_ONLY_CALLBACKS: tuple[type[FederationCallback], ...] = (MembershipInferenceAudit, SourceInferenceAudit,
                                                                   ClusterMetrics)


def check_deployable(algorithm: Algorithm, callbacks: list[Any]) -> None:
    """Refuse, with one line, an algorithm or callback that cannot run with its clients on nodes.

    An algorithm that says why it cannot (``Algorithm.deploy_refusal``), and audits that read
    every client's data on the server, which has no data.
    """
    if algorithm.deploy_refusal is not None:
        raise ConfigError(f"{type(algorithm).__name__} cannot run in a Flower deployment: it "
                          f"{algorithm.deploy_refusal} (run it with python -m fedfdp.fit)")
    for cb in callbacks:
        if isinstance(cb, SIMULATION_ONLY_CALLBACKS) or (isinstance(cb, FederationCallback)
                                                        and not cb.supports_distributed):
            raise ConfigError(f"callbacks.{type(cb).__name__} reads every client's data on the server and cannot run "
                              f"in a Flower deployment; remove it from trainer.callbacks")


class FlowerFederation(Federation):
    """:class:`fedfdp.Federation` whose clients are Flower SuperNodes (module docstring).

    Constructed from the config like :class:`~fedfdp.Federation`; :meth:`connect` gives it the
    Flower grid and the nodes before fitting.
    """

    grid: Grid
    config_text: str
    round_timeout: float

    def connect(self, grid: Grid, nodes: dict[int, int], config_text: str, round_timeout: float,
                straggler_timeout: float | None = None, described: dict[int, NodeDescription] | None = None) -> None:
        """Use ``grid`` to reach ``nodes`` (partition → Flower node id at the start) with the run's ``config_text``.

        A message round waits at most ``round_timeout`` seconds, and at most ``straggler_timeout``
        seconds after its first reply (None: no such limit). ``described``: each partition's
        description at the start, which a node that takes a partition over during the run must
        match (:class:`~fedfdp.flower.roster.NodeRoster`; None: no node takes over).
        """
        self.grid = grid
        self.roster = NodeRoster(nodes, described or {})
        self.take_over = described is not None
        self.config_text = config_text
        self.round_timeout = round_timeout
        self.straggler_timeout = straggler_timeout
        self.refusals: list[tuple[int, int, str]] = []  # (round, client, reason)
        self.client_epsilon: dict[int, float] = {}  # the ε each client last reported (its own ledger)
        self.stacked_round = False  # each client trains on its own node
        # the nodes keep each client's algorithm state under this run's key (kept by a resume), and
        # continue from the state after the last round whose upload the server received
        self.run_key = uuid.uuid4().hex
        self.client_rounds: dict[int, int] = {}
        self.participation = Participation()  # the sampled clients left out of each round

    @property
    def nodes(self) -> dict[int, int]:
        """Partition → the node serving it now (or last, for a client whose node was lost)."""
        return dict(self.roster.serving)

    @property
    def dropped(self) -> set[int]:
        """The clients without a live node now (lost or not answering, and no node took over)."""
        return set(self.roster.without_node())

    def _state_key(self, client_id: int) -> protocol.ClientStateKey:
        """Which of the node's saved states client ``client_id`` continues from."""
        return protocol.ClientStateKey(self.run_key, self.client_rounds.get(client_id, -1))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The federation's state plus the deployment's record so far (refusals, reported ε)."""
        super().on_save_checkpoint(checkpoint)
        checkpoint["flower"] = {"refusals": [list(r) for r in self.refusals],
                                "client_epsilon": {str(c): e for c, e in self.client_epsilon.items()},
                                "run_key": self.run_key,
                                "client_rounds": {str(c): r for c, r in self.client_rounds.items()},
                                "left_out": self.participation.state_dict()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Continue the record of a resumed run: its refusals and left-out clients up to the checkpoint
        (the rounds after it are replayed), the ε reported.

        Nodes that stopped answering in the earlier session are asked again.
        """
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get("flower", {})
        start = int(checkpoint.get("global_step", 0))
        self.refusals = [(int(r), int(c), str(why)) for r, c, why in saved.get("refusals", []) if int(r) < start]
        self.client_epsilon.update({int(c): float(e) for c, e in saved.get("client_epsilon", {}).items()})
        self.run_key = str(saved.get("run_key", self.run_key))
        self.client_rounds = {int(c): int(r) for c, r in saved.get("client_rounds", {}).items()}
        self.participation.load_state_dict(saved.get("left_out", {}))
        self.participation.forget_from(start + 1)

    def on_fit_start(self) -> None:
        """The clients' one-off releases before training come from their nodes; then the simulation's start."""
        if self.algorithm.needs_fit_start_release():
            self._fit_start_releases()
        super().on_fit_start()

    def _fit_start_releases(self) -> None:
        """Ask every node for its client's one-off release (charged on the node first), charge the
        server's view of it, and give them all to the algorithm (which needs every client's)."""
        accountant = self.accountant
        if accountant is None:
            raise ConfigError(f"{type(self.algorithm).__name__} makes a private release at fit start and needs "
                              f"callbacks.RDPAccounting")
        replies = self._exchange({cid: protocol.query_request(self.config_text) for cid in range(self.num_clients)},
                                 protocol.FIT_START)
        releases = {}
        for cid in range(self.num_clients):
            reply = replies.get(cid)
            if reply is None or reply.has_error():
                why = "no answer" if reply is None else reply.error.reason
                raise FedFDPError(f"client {cid} made no release at fit start ({why}); "
                                  f"{type(self.algorithm).__name__} needs every client's")
            client, events, release, epsilon = protocol.decode_fit_start(reply.content)
            if client != cid or events != self.algorithm.fit_start_events(cid):
                raise RuntimeError(f"the node of client {cid} released {events} for client {client} at fit start; "
                                   f"expected {self.algorithm.fit_start_events(cid)}")
            accountant.compose(cid, events, round_idx=self.start_round)
            self.client_epsilon[cid] = epsilon
            releases[cid] = release
        self.algorithm.take_fit_start_releases(releases)

    def setup(self, stage: str) -> None:
        """The federation's setup, after refusing what cannot run on nodes."""
        check_deployable(self.algorithm, list(self.trainer.callbacks))
        super().setup(stage)

    def _loss_bounds(self, client_id: int) -> dict[str, float]:
        """The client's current loss-clip bound of each loss-release callback (sent with its round)."""
        bounds: dict[str, float] = {}
        for cb in self.federation_callbacks():
            bound = getattr(cb, "bound", None)
            if callable(bound) and isinstance(getattr(cb, "bounds", None), dict):
                bounds[type(cb).__name__] = float(bound(client_id))
        return bounds

    def _where(self, message_type: str) -> str:
        return f"round {self.current_round + 1}" if message_type == protocol.TRAIN else f"the {message_type} message"

    def _refresh_nodes(self, where: str) -> None:
        """Before a message round: take the SuperLink's connected nodes into account (restarted nodes)."""
        connected = self._connected_nodes()
        if connected is None or not self.take_over:
            if connected is not None:
                self.roster.connected = connected
            return
        self.roster.refresh(connected, lambda new: describe_nodes(
            self.grid, new, self.config_text, timeout=self.round_timeout, straggler_timeout=self.straggler_timeout),
            where)

    def _exchange(self, contents: dict[int, Any], message_type: str) -> dict[int, Message]:
        """Send each client's content to its node; the replies that came back in time, by client.

        Clients without a live node are not sent anything (their absence is logged once per round).
        """
        where = self._where(message_type)
        self._refresh_nodes(where)
        nodes = {cid: self.roster.live(cid) for cid in contents}
        targets = {cid: content for cid, content in contents.items() if nodes[cid] is not None}
        absent = sorted(set(contents) - set(targets))
        if absent:
            logger.warning("%s: client%s %s left out: no live SuperNode (%s)", where, "s" if len(absent) > 1 else "",
                           ", ".join(map(str, absent)), "; ".join(
                               f"client {c}'s SuperNode {self.roster.serving[c]} stopped answering in "
                               f"{self.roster.lost_in.get(c, 'an earlier round')}" for c in absent))
        messages = [Message(content, dst_node_id=nodes[cid], message_type=message_type)
                    for cid, content in targets.items()]
        by_node = {nodes[cid]: cid for cid in targets}
        replies: dict[int, Message] = {}
        lost: set[int] = set()
        for reply in exchange(self.grid, messages, timeout=self.round_timeout,
                              straggler_timeout=self.straggler_timeout):
            cid = by_node.get(reply.metadata.src_node_id)
            if cid is None:  # the SuperLink answers for a node it gave up on (src is the SuperLink)
                cid = next((c for c, m in zip(targets, messages) if m.object_id == reply.metadata.reply_to_message_id),
                           None)
            if cid is None:
                continue
            if reply.has_error() and reply.error.code == ErrorCode.NODE_UNAVAILABLE:
                lost.add(cid)
            else:
                replies[cid] = reply
        connected = self._connected_nodes()
        for cid in targets:
            if cid in replies:
                continue
            node = nodes[cid]
            self.roster.fail(node, where)  # type: ignore[arg-type]
            if cid in lost or (connected is not None and node not in connected):
                logger.warning("client %d: its SuperNode %d was lost in %s (the SuperLink no longer hears its "
                               "heartbeat): left out until a SuperNode for partition-id=%d connects", cid, node, where,
                               cid)
            else:
                logger.warning("client %d (node %d) did not answer %s in time (round-timeout %.0f s, "
                               "straggler-timeout %s s) though still connected: left out, and that node is not asked "
                               "again while it stays connected", cid, node, where, self.round_timeout,
                               self.straggler_timeout)
        return replies

    def _connected_nodes(self) -> set[int] | None:
        """The node ids the SuperLink counts as connected now (None when the grid cannot say)."""
        try:
            return set(self.grid.get_node_ids())
        except Exception:  # noqa: BLE001 - a SuperLink gone away: nothing to classify with
            return None

    def train_clients(self, context: RoundContext, client_ids: list[int],
                      global_params: torch.Tensor) -> list[ClientUpdate]:
        """Each sampled client's round on its node; the uploads that arrived, in client order."""
        server_state = self.algorithm.public_server_state()
        contents = {cid: protocol.TrainRequest(round=context.round, partition=cid, config=self.config_text,
                                               broadcast=dict(context.broadcast), loss_bounds=self._loss_bounds(cid),
                                               state_key=self._state_key(cid)).encode(global_params, server_state)
                    for cid in client_ids}
        replies = self._exchange(contents, protocol.TRAIN)
        updates: list[ClientUpdate] = []
        refused: list[str] = []
        for cid in client_ids:
            reply = replies.get(cid)
            if reply is None:
                continue
            if reply.has_error():
                logger.warning("round %d: client %d failed on its node: %s", context.round + 1, cid, reply.error.reason)
                continue
            result = protocol.decode_train_reply(reply.content)
            self.client_epsilon[cid] = protocol.reported_epsilon(reply.content)
            if isinstance(result, Refusal):
                logger.warning("round %d: %s", context.round + 1, result.reason)
                self.refusals.append((context.round, cid, result.reason))
                refused.append(result.reason)
                continue
            if result.client_id != cid:
                raise RuntimeError(f"the node of client {cid} answered for client {result.client_id}")
            self.client_rounds[cid] = context.round  # the node saved its state after this round
            self._call("on_client_release", result)  # checked, written to the run's ledger and charged
            updates.append(result)
        refusers = [c for r, c, _ in self.refusals if r == context.round]
        self.participation.record(context.round + 1, client_ids, [u.client_id for u in updates], refusers)
        self._round_counts = {"clients_uploaded": float(len(updates)), "clients_refused": float(len(refused)),
                              "clients_missing": float(len(client_ids) - len(updates) - len(refused))}
        if not updates and (client_ids or not self._releases_aggregate()):
            raise FedFDPError(f"round {context.round + 1}: no client released an update "
                              f"({len(refused)} refused, {len(client_ids) - len(refused)} failed or did not answer)"
                              + (f"; first refusal: {refused[0]}" if refused else ""))
        return updates

    def _releases_aggregate(self) -> bool:
        """Whether the round's release is the mechanism's noisy aggregate (client-level DP), which a
        round whose Poisson cohort is empty makes too (noise alone)."""
        mechanism = self.privacy_mechanism
        return mechanism is not None and mechanism.releases_aggregate

    def training_step(self, batch: Any, batch_idx: int) -> None:
        """The simulation's round; also logs how many clients uploaded, refused or were missing."""
        super().training_step(batch, batch_idx)
        for key, value in getattr(self, "_round_counts", {}).items():
            self.log(key, value, on_step=True, on_epoch=False)

    def deployment_record(self, described: dict[int, NodeDescription]) -> dict[str, Any]:
        """Per client: its nodes, its own settings, the ε it reported and the server counted, refused and
        missed rounds (1-based), and whether it has no live node at the end."""
        accounting = self.accountant
        missed = self.participation.left_out("missing")
        clients = {}
        for cid in range(self.num_clients):
            info = described[cid]
            clients[str(cid)] = {
                "node_id": self.roster.serving[cid], "node_ids": self.roster.served_by.get(cid, []),
                "target_epsilon": info.target_epsilon, "secure_rng": info.secure_rng,
                "epsilon_before_run": info.epsilon, "epsilon_reported": self.client_epsilon.get(cid),
                "epsilon_server_view": accounting.client_epsilon(cid) if accounting is not None else None,
                "refused_rounds": [r + 1 for r, c, _ in self.refusals if c == cid],
                "missed_rounds": missed.get(cid, []), "dropped": cid in self.dropped}
        try:
            run: str | None = str(self.grid.run.run_id)
        except Exception:  # noqa: BLE001 - a grid without a run (tests' in-process grid)
            run = None
        return {"run": run,
                "refusals": [{"round": r + 1, "client": c, "reason": why} for r, c, why in self.refusals],
                "clients": clients}

    def left_out_lines(self) -> list[str]:
        """One line per client left out of rounds (which rounds, why), for the end of the run's log."""
        refused = self.participation.left_out("refused")
        return [f"client {cid} was left out of {rounds_phrase(rounds)} of {self.total_rounds}"
                + (f" ({len(refused[cid])} refused on its own budget)" if cid in refused else "")
                for cid, rounds in self.participation.left_out().items()]

    def _evaluate_splits(self, splits: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        """Every node evaluates the run's model on its own ``splits`` (one message each).

        Clients whose node does not answer get NaN (left out of the fairness summary).
        """
        params = parameters_to_vector(trainable(self.released_model)).detach()
        server_state = self.algorithm.public_server_state()
        contents = {cid: protocol.EvaluateRequest(partition=cid, config=self.config_text, splits=tuple(splits),
                                                  state_key=self._state_key(cid)).encode(params, server_state)
                    for cid in range(self.num_clients)}
        replies = self._exchange(contents, protocol.EVALUATE)
        n = self.num_clients
        sums = {s: {k: torch.full((n,), math.nan, dtype=torch.float64) for k in ("correct", "count", "loss_sum")}
                for s in splits}
        for cid, reply in replies.items():
            if reply.has_error():
                logger.warning("evaluation: client %d failed on its node: %s", cid, reply.error.reason)
                continue
            client, counts = protocol.decode_evaluation(reply.content)
            for split, (correct, count, loss_sum) in counts.items():
                for key, value in (("correct", correct), ("count", count), ("loss_sum", loss_sum)):
                    sums[split][key][client] = value
        out: dict[str, dict[str, torch.Tensor]] = {}
        for split, s in sums.items():
            answered = ~torch.isnan(s["count"])
            if not bool(answered.any()):
                raise FedFDPError("evaluation: no node answered")
            count = s["count"].clamp(min=1)
            out[split] = {"accuracy": s["correct"] / count, "loss": s["loss_sum"] / count,
                          "pooled_accuracy": s["correct"][answered].sum() / s["count"][answered].sum().clamp(min=1)}
        return out
