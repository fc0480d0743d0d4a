"""What the ServerApp and the ClientApps send each other: Flower records in, fedfdp values out.

Three message types, each answered by one reply from the node of one partition (client):

``query``
    server → node: the run's config. Reply ``"node"``: the partition, the data sizes, the node's
    own privacy settings (target ε, secure RNG) and the ε it has spent so far.
``train``
    server → node: ``w_t`` (``"model"``, one float32 vector), the round, the algorithm's
    broadcast (``F̄_t``), the client's loss-clip bound, the config, the algorithm's public server
    state (``"server_state"``: e.g. SCAFFOLD's ``c``), the run's key and the last round the server
    received this client's upload (which of the node's saved client states to continue from).
    Reply: either the upload (``"model"``: the local model; ``"release"``: the DP events charged
    and the noisy loss; ``"extras"``: the algorithm's declared upload fields, e.g. SCAFFOLD's
    ``Δc_i``) or a refusal with its reason. Simulation-only diagnostics (raw losses, clipped
    fractions) are never sent: they are not private; nor is the client's own state.
``query.fit_start``
    server → node: the config. Reply: the client's one-off release before training (e.g. its
    noisy label histogram: ``"extras"``) with its DP events, charged to the node's ledger first.
``evaluate``
    server → node: the run's released model, the splits wanted, and what picks the client's own
    evaluation model (public server state, run key, client round: a personal or cluster model).
    Reply ``"evaluation"``: correct count, sample count and loss sum per split, on the node's own data.

The flat parameter vector travels as one float32 numpy array and the extras as arrays of their
own dtype, so a model crosses the wire bit for bit.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedfdp.privacy.accounting import DPEvent
from fedfdp.types import ClientUpdate

__all__ = ["ClientStateKey", "EvaluateRequest", "NodeDescription", "Refusal", "TrainRequest", "decode_evaluation",
           "decode_fit_start", "decode_node", "encode_fit_start",
           "decode_train_reply", "encode_evaluation", "encode_node", "encode_refusal", "encode_update",
           "params_of", "query_request", "reported_epsilon", "server_state_of", "vector_record"]

QUERY, TRAIN, EVALUATE = "query", "train", "evaluate"
#: the clients' one-off release before training (``Algorithm.fit_start_release``), a query action
FIT_START_ACTION = "fit_start"
FIT_START = f"{QUERY}.{FIT_START_ACTION}"
_CONFIG, _MODEL, _RELEASE, _NODE, _EVAL = "fedfdp", "model", "release", "node", "evaluation"
_EXTRAS, _SERVER_STATE = "extras", "server_state"
_BROADCAST, _BOUND = "broadcast.", "loss_bound."


def vector_record(vector: torch.Tensor) -> ArrayRecord:
    """A flat float32 parameter vector as an ArrayRecord (one array)."""
    return ArrayRecord([vector.detach().cpu().to(torch.float32).numpy().copy()])


def params_of(content: RecordDict) -> torch.Tensor:
    """The flat parameter vector of a message (``"model"``)."""
    arrays = content.array_records[_MODEL].to_numpy_ndarrays()
    return torch.from_numpy(np.ascontiguousarray(arrays[0], dtype=np.float32))


def _state_record(state: dict[str, Any]) -> ArrayRecord:
    """An algorithm's public server state (tensors, numbers, lists, None) as one byte array.

    Serialised with ``torch.save`` and read back with ``weights_only=True``: no code crosses the wire.
    """
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return ArrayRecord([np.frombuffer(buffer.getvalue(), dtype=np.uint8).copy()])


def server_state_of(content: RecordDict) -> dict[str, Any]:
    """The public server state a request carries (empty when it carries none)."""
    if _SERVER_STATE not in content.array_records:
        return {}
    raw = content.array_records[_SERVER_STATE].to_numpy_ndarrays()[0]
    return torch.load(io.BytesIO(raw.tobytes()), weights_only=True)


@dataclass(frozen=True)
class ClientStateKey:
    """Which of a node's saved client states a request continues from.

    ``run_key`` names the fedfdp run (kept across resumes, unlike Flower's run id);
    ``client_round`` is the last round (0-based) whose upload from this client the server
    received, -1 before its first: the node continues from its state saved after that round.
    """

    run_key: str = ""
    client_round: int = -1


@dataclass(frozen=True)
class TrainRequest:
    """One round's work for one client (what the server broadcasts to it besides ``w_t``)."""

    round: int
    partition: int
    config: str
    broadcast: dict[str, float] = field(default_factory=dict)
    loss_bounds: dict[str, float] = field(default_factory=dict)
    """The client's current loss-clip bound per loss-release callback (by class name)."""
    state_key: ClientStateKey = field(default_factory=ClientStateKey)

    def encode(self, params: torch.Tensor, server_state: dict[str, Any] | None = None) -> RecordDict:
        """The message content with ``w_t`` and the algorithm's public server state."""
        record = ConfigRecord({"round": self.round, "partition": self.partition, "config": self.config,
                               "run_key": self.state_key.run_key, "client_round": self.state_key.client_round,
                               **{_BROADCAST + k: float(v) for k, v in self.broadcast.items()},
                               **{_BOUND + k: float(v) for k, v in self.loss_bounds.items()}})
        content = RecordDict({_CONFIG: record, _MODEL: vector_record(params)})
        if server_state:
            content[_SERVER_STATE] = _state_record(server_state)
        return content

    @classmethod
    def decode(cls, content: RecordDict) -> TrainRequest:
        """The request of a ``train`` message (the model: :func:`params_of`; the state: :func:`server_state_of`)."""
        rec = content.config_records[_CONFIG]
        return cls(round=int(rec["round"]), partition=int(rec["partition"]), config=str(rec["config"]),
                   broadcast={k[len(_BROADCAST):]: float(v) for k, v in rec.items() if k.startswith(_BROADCAST)},
                   loss_bounds={k[len(_BOUND):]: float(v) for k, v in rec.items() if k.startswith(_BOUND)},
                   state_key=ClientStateKey(str(rec.get("run_key", "")), int(rec.get("client_round", -1))))  # type: ignore[arg-type]


@dataclass(frozen=True)
class EvaluateRequest:
    """Evaluate the run's model on the node's splits ``splits`` (``test``, ``train``, ``val``).

    The client is evaluated on its own evaluation model (``Algorithm.evaluation_groups``: the
    released model, or its personal or cluster model), picked on the node from the public server
    state and the client's saved state (``state_key``).
    """

    partition: int
    config: str
    splits: tuple[str, ...]
    state_key: ClientStateKey = field(default_factory=ClientStateKey)

    def encode(self, params: torch.Tensor, server_state: dict[str, Any] | None = None) -> RecordDict:
        """The message content with the model to evaluate and the algorithm's public server state."""
        record = ConfigRecord({"partition": self.partition, "config": self.config, "splits": list(self.splits),
                               "run_key": self.state_key.run_key, "client_round": self.state_key.client_round})
        content = RecordDict({_CONFIG: record, _MODEL: vector_record(params)})
        if server_state:
            content[_SERVER_STATE] = _state_record(server_state)
        return content

    @classmethod
    def decode(cls, content: RecordDict) -> EvaluateRequest:
        """The request of an ``evaluate`` message."""
        rec = content.config_records[_CONFIG]
        return cls(partition=int(rec["partition"]), config=str(rec["config"]),
                   splits=tuple(str(s) for s in rec["splits"]),  # type: ignore[union-attr]
                   state_key=ClientStateKey(str(rec.get("run_key", "")), int(rec.get("client_round", -1))))  # type: ignore[arg-type]


def query_request(config: str) -> RecordDict:
    """A ``query`` message's content: the run's config."""
    return RecordDict({_CONFIG: ConfigRecord({"config": config})})


def config_of(content: RecordDict) -> str:
    """The run's config (YAML text) of any request."""
    return str(content.config_records[_CONFIG]["config"])


@dataclass(frozen=True)
class Refusal:
    """A client declined a round: its ``reason`` (budget), and the ε it has spent (all runs)."""

    client_id: int
    reason: str
    epsilon: float


def encode_update(update: ClientUpdate, epsilon: float) -> RecordDict:
    """A client's upload: the local model, ``|D_i|``, the (noisy) loss, the algorithm's extras,
    the DP events charged, its ε. (The server checks every field against the algorithm's
    ``upload_privacy`` as in a simulation.)"""
    release = ConfigRecord({
        "status": "ok", "client": update.client_id, "num_examples": int(update.num_examples),
        "kinds": [kind for kind, _ in update.dp_events],
        "sigmas": [float(e.noise_multiplier) for _, e in update.dp_events],
        "rates": [float(e.sample_rate) for _, e in update.dp_events],
        "steps": [int(e.steps) for _, e in update.dp_events],
        "epsilon": float(epsilon)})
    if update.reported_loss is not None:
        release["reported_loss"] = float(update.reported_loss)
    content = RecordDict({_RELEASE: release, _MODEL: vector_record(update.params)})
    if update.extras:
        content[_EXTRAS] = ArrayRecord({k: v.detach().cpu().contiguous() for k, v in update.extras.items()})
    return content


def encode_fit_start(client_id: int, events: list[tuple[str, DPEvent]], release: dict[str, torch.Tensor],
                     epsilon: float) -> RecordDict:
    """A client's one-off release before training, with the events it charged and its ε."""
    record = ConfigRecord({"status": "ok", "client": client_id, "kinds": [k for k, _ in events],
                           "sigmas": [float(e.noise_multiplier) for _, e in events],
                           "rates": [float(e.sample_rate) for _, e in events],
                           "steps": [int(e.steps) for _, e in events], "epsilon": float(epsilon)})
    return RecordDict({_RELEASE: record, _EXTRAS: ArrayRecord({k: v.detach().cpu().contiguous()
                                                                for k, v in release.items()})})


def decode_fit_start(content: RecordDict) -> tuple[int, list[tuple[str, DPEvent]], dict[str, torch.Tensor], float]:
    """``(client, events, release, ε)`` of a ``query.fit_start`` reply."""
    rec = content.config_records[_RELEASE]
    events = [(str(kind), DPEvent(noise_multiplier=float(s), sample_rate=float(q), steps=int(n)))
              for kind, s, q, n in zip(rec["kinds"], rec["sigmas"], rec["rates"], rec["steps"])]  # type: ignore[arg-type]
    release = dict(content.array_records[_EXTRAS].to_torch_state_dict())
    return int(rec["client"]), events, release, float(rec["epsilon"])  # type: ignore[arg-type]


def encode_refusal(client_id: int, reason: str, epsilon: float) -> RecordDict:
    """A client's refusal to train this round."""
    return RecordDict({_RELEASE: ConfigRecord({"status": "refused", "client": client_id, "reason": reason,
                                               "epsilon": float(epsilon)})})


def decode_train_reply(content: RecordDict) -> ClientUpdate | Refusal:
    """The upload (a :class:`~fedfdp.types.ClientUpdate`) or the :class:`Refusal` of a ``train`` reply."""
    rec = content.config_records[_RELEASE]
    client = int(rec["client"])  # type: ignore[arg-type]
    if rec["status"] == "refused":
        return Refusal(client_id=client, reason=str(rec["reason"]), epsilon=float(rec["epsilon"]))  # type: ignore[arg-type]
    events = [(str(kind), DPEvent(noise_multiplier=float(s), sample_rate=float(q), steps=int(n)))
              for kind, s, q, n in zip(rec["kinds"], rec["sigmas"], rec["rates"], rec["steps"])]  # type: ignore[arg-type]
    loss = rec.get("reported_loss")
    extras = dict(content.array_records[_EXTRAS].to_torch_state_dict()) if _EXTRAS in content.array_records else {}
    update = ClientUpdate(client_id=client, params=params_of(content), num_examples=int(rec["num_examples"]),  # type: ignore[arg-type]
                          dp_events=events, reported_loss=None if loss is None else float(loss),  # type: ignore[arg-type]
                          extras=extras)
    return update


def reported_epsilon(content: RecordDict) -> float:
    """The ε the client says it has spent (its own ledger, every run) in a ``train`` reply."""
    return float(content.config_records[_RELEASE]["epsilon"])  # type: ignore[arg-type]


@dataclass(frozen=True)
class NodeDescription:
    """What a node tells the server at the start of a run."""

    partition: int
    num_partitions: int
    train_size: int
    test_size: int
    val_size: int
    target_epsilon: float | None
    secure_rng: bool
    epsilon: float
    """ε the client has spent before this run (every release in its ledger)."""


def encode_node(node: NodeDescription) -> RecordDict:
    """The reply to a ``query``."""
    return RecordDict({_NODE: ConfigRecord({
        "partition": node.partition, "num_partitions": node.num_partitions, "train_size": node.train_size,
        "test_size": node.test_size, "val_size": node.val_size,
        "target_epsilon": -1.0 if node.target_epsilon is None else float(node.target_epsilon),
        "secure_rng": node.secure_rng, "epsilon": float(node.epsilon)})})


def decode_node(content: RecordDict) -> NodeDescription:
    """The :class:`NodeDescription` of a ``query`` reply."""
    rec = content.config_records[_NODE]
    target = float(rec["target_epsilon"])  # type: ignore[arg-type]
    return NodeDescription(partition=int(rec["partition"]), num_partitions=int(rec["num_partitions"]),  # type: ignore[arg-type]
                           train_size=int(rec["train_size"]), test_size=int(rec["test_size"]),  # type: ignore[arg-type]
                           val_size=int(rec["val_size"]), target_epsilon=None if target < 0 else target,  # type: ignore[arg-type]
                           secure_rng=bool(rec["secure_rng"]), epsilon=float(rec["epsilon"]))  # type: ignore[arg-type]


def encode_evaluation(client_id: int, counts: dict[str, tuple[float, float, float]]) -> RecordDict:
    """The reply to an ``evaluate``: ``{split: (correct, count, loss_sum)}`` on the node's data."""
    metrics: dict[str, float | int] = {"client": client_id}
    for split, (correct, count, loss_sum) in counts.items():
        metrics.update({f"{split}.correct": float(correct), f"{split}.count": float(count),
                        f"{split}.loss_sum": float(loss_sum)})
    return RecordDict({_EVAL: MetricRecord(metrics)})


def decode_evaluation(content: RecordDict) -> tuple[int, dict[str, tuple[float, float, float]]]:
    """``(client, {split: (correct, count, loss_sum)})`` of an ``evaluate`` reply."""
    rec = content.metric_records[_EVAL]
    splits = {key.split(".")[0] for key in rec if "." in key}
    return int(rec["client"]), {s: (float(rec[f"{s}.correct"]), float(rec[f"{s}.count"]),  # type: ignore[arg-type]
                                    float(rec[f"{s}.loss_sum"])) for s in splits}  # type: ignore[arg-type]
