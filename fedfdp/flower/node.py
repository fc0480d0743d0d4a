"""One client on its own node: the run's config, the node's partition, and its own privacy ledger.

A :class:`NodeClient` is built from the run's YAML config (the same file ``python -m fedfdp.fit``
reads, sent by the server) and the node's settings (Flower ``--node-config``). It instantiates
the same :class:`~fedfdp.Federation` (client module, algorithm, release callbacks) and the same
datamodule as a simulation, keeps only its own partition's splits, and runs exactly what a
simulation runs for one client (:meth:`fedfdp.Federation.train_client`): the algorithm's local
update from the server's ``w_t`` on the client's own random stream, the privatised releases of
the callbacks (``NoisyLossReporting``), and the charge of every release to the client's own
ledger (:class:`~fedfdp.flower.node_ledger.NodeLedgerCallback`) before the upload is returned.
The algorithm's client state (control variates, personal models) is restored before and saved
after the round on the node (:mod:`fedfdp.flower.node_state`); the server state it reads comes
with the round (``Algorithm.public_server_state``).

Node settings (``--node-config "partition-id=0 num-partitions=3 ..."``):

``partition-id``, ``num-partitions``
    which client of the config's ``data`` this node holds; ``num-partitions`` must equal
    ``data.num_clients``.
``ledger-dir``
    where the client's ledger lives (default ``~/.fedfdp/ledgers``), one file per partition, and
    its algorithm state, one file per run and partition.
``target-epsilon``
    the client's own budget; default: the config's ``RDPAccounting.target_epsilon``.
``secure-rng``
    draw Poisson samples and noise from the OS CSPRNG (default ``true``); ``false`` uses the
    config's seeded streams, as a simulation does (for the equivalence test).
``data-dir``
    where this node's data files are (default: the config's ``data.init_args.data_dir``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.cli import LightningCLI
from torch.nn.utils import vector_to_parameters

from callbacks.base import FederationCallback
from datamodules.checks import is_int
from fedfdp.cli.parser import FedFDPCLI, build_cli
from fedfdp.client import trainable
from fedfdp.errors import PrivacyBudgetError, require
from fedfdp.federation import Federation
from fedfdp.flower.node_ledger import NodeLedger, NodeLedgerCallback
from fedfdp.flower.node_state import NodeStateFile
from fedfdp.flower.protocol import ClientStateKey, NodeDescription
from fedfdp.metrics import evaluate_clientwise
from fedfdp.privacy.accountant import run_accountant_of
from fedfdp.privacy.mechanism import checked_one_off_release
from fedfdp.privacy.accounting import PAPER_ORDERS, DPEvent
from fedfdp.privacy.probe import model_clip_bound, probe_client
from fedfdp.privacy.validation import check_releases, sample_mixing_layers
from fedfdp.types import ClientUpdate, RoundContext

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_LEDGER_DIR", "NodeClient", "NodeSettings", "release_callbacks"]

DEFAULT_LEDGER_DIR = "~/.fedfdp/ledgers"
_LOCAL_OPTIMIZER = "client.local_optimizer/"
"""Prefix of the client's kept local-optimizer state (``ClientModule.local_optimizer_states``) in the
node's state file, beside the algorithm's client state (no algorithm attribute has a dot)."""
_KEYS = ("partition-id", "num-partitions", "ledger-dir", "target-epsilon", "secure-rng", "data-dir")


@dataclass(frozen=True)
class NodeSettings:
    """The node's own settings (Flower ``--node-config``); see the module docstring."""

    partition_id: int
    num_partitions: int
    ledger_dir: Path
    target_epsilon: float | None = None
    secure_rng: bool = True
    data_dir: str | None = None

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> NodeSettings:
        """Parse and check ``--node-config`` values (one-line :class:`~fedfdp.errors.ConfigError` on a bad one)."""
        unknown = sorted(set(node_config) - set(_KEYS))
        require(not unknown, f"node-config has unknown keys {unknown}; accepted: {list(_KEYS)}")
        for key in ("partition-id", "num-partitions"):
            require(key in node_config, f"node-config must set {key} (e.g. --node-config "
                                        f"\"partition-id=0 num-partitions=3\")")
        pid, num = node_config["partition-id"], node_config["num-partitions"]
        require(is_int(num, 1), f"node-config num-partitions must be an integer >= 1, got {num!r}")
        require(is_int(pid, 0) and pid < num, f"node-config partition-id must be an integer in [0, {num}), got {pid!r}")
        target = node_config.get("target-epsilon")
        require(target is None or (isinstance(target, (int, float)) and not isinstance(target, bool)
                                   and math.isfinite(target) and target > 0),
                f"node-config target-epsilon must be a number > 0, got {target!r}")
        secure = node_config.get("secure-rng", True)
        require(isinstance(secure, bool), f"node-config secure-rng must be true or false, got {secure!r}")
        ledger_dir = node_config.get("ledger-dir", DEFAULT_LEDGER_DIR)
        require(isinstance(ledger_dir, str) and ledger_dir != "",
                f"node-config ledger-dir must be a quoted path (ledger-dir='/path'), got {ledger_dir!r}")
        data_dir = node_config.get("data-dir")
        require(data_dir is None or (isinstance(data_dir, str) and data_dir != ""),
                f"node-config data-dir must be a quoted path (data-dir='/path'), got {data_dir!r}")
        return cls(partition_id=int(pid), num_partitions=int(num), ledger_dir=Path(ledger_dir).expanduser(),
                   target_epsilon=None if target is None else float(target), secure_rng=secure, data_dir=data_dir)


class _NodeCLI(FedFDPCLI):
    """The config's parser and classes without a run directory, loggers or checkpoints (a node writes none)."""

    def check_trainer_options(self, parser: Any) -> None:
        """Nothing to check: the node's trainer is never fitted (and has no checkpoints by design)."""

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """A plain trainer holding the config's callbacks (never fitted on a node)."""
        return LightningCLI.instantiate_trainer(self, **kwargs)


def release_callbacks(callbacks: list[Any]) -> list[FederationCallback]:
    """The callbacks that act on a client's upload before it leaves (``on_client_update``: loss releases)."""
    return [cb for cb in callbacks if isinstance(cb, FederationCallback)
            and type(cb).on_client_update is not FederationCallback.on_client_update]


class NodeClient:
    """Client ``settings.partition_id`` of the run configured by ``config`` (YAML text), on this node.

    Args:
        config: the run's config (the YAML the server read).
        settings: the node's settings.
        run: the Flower run id, written with each ledger entry.
    """

    def __init__(self, config: str, settings: NodeSettings, run: str | None = None) -> None:
        args = ["--config", config, "--trainer.devices", "1", "--trainer.num_nodes", "1", "--trainer.strategy", "auto",
                "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
                "--trainer.enable_progress_bar", "false", "--model.secure_rng", str(settings.secure_rng).lower()]
        if settings.data_dir is not None:
            args += ["--data.init_args.data_dir", settings.data_dir]
        cli = build_cli(args, cli_class=_NodeCLI)
        self.settings = settings
        self.run = run
        self.client_id = settings.partition_id
        self.federation: Federation = cli.model
        self.datamodule = cli.datamodule
        require(settings.num_partitions == self.datamodule.num_clients,
                f"node-config num-partitions={settings.num_partitions} but the run's data.num_clients="
                f"{self.datamodule.num_clients}")
        self.datamodule.setup("fit")
        fed = self.federation
        fed.datamodule = self.datamodule  # what Federation.setup binds in a simulation
        accounting = run_accountant_of(cli.trainer.callbacks)
        target = settings.target_epsilon if settings.target_epsilon is not None else (
            accounting.target_epsilon if accounting is not None else None)
        self.ledger = NodeLedger(settings.ledger_dir, self.client_id, target_epsilon=target,
                                 delta=accounting.delta if accounting is not None else 1e-5,
                                 orders=accounting.orders if accounting is not None else PAPER_ORDERS,
                                 accountant=accounting.accountant if accounting is not None else "rdp")
        self.callbacks = release_callbacks(cli.trainer.callbacks)
        cli.trainer.callbacks = [*self.callbacks, NodeLedgerCallback(self.ledger, run)]
        fed.trainer = cli.trainer
        fed.node_accounting = accounting
        cli.trainer.strategy.connect(fed)  # plain (non-private) steps go through Lightning's manual_backward
        fed.algorithm.setup(fed)
        self.planned = fed.planned_dp_events(self.client_id)
        if self.planned:  # the client's own check: every release it makes has a guarantee
            releases = [*fed.algorithm.dp_releases(), *(r for cb in self.callbacks for r in cb.dp_releases(fed))]
            check_releases(releases)
            mixing = sample_mixing_layers(fed.client.net)
            require(not mixing, f"model.client.init_args.net has layers that mix the samples of a batch "
                                f"({', '.join(mixing)}: BatchNorm); this client releases nothing through it")
            bound = model_clip_bound(releases)
            if bound is not None:  # the model and loss this node trains, on a probe batch shaped like its records
                x, y = self.datamodule.client_train(self.client_id)
                problems = probe_client(fed.client, x[:1], y[:1], bound)
                require(not problems, f"{problems[0] if problems else ''}; this client releases nothing through it")

    def describe(self) -> NodeDescription:
        """The node's answer to the server's ``query``."""
        dm, cid = self.datamodule, self.client_id
        return NodeDescription(partition=cid, num_partitions=self.settings.num_partitions,
                               train_size=int(dm.train_sizes[cid]), test_size=int(dm.test_sizes[cid]),
                               val_size=int(dm.val_sizes[cid]) if len(dm.val_sizes) else 0,
                               target_epsilon=self.ledger.target_epsilon, secure_rng=self.settings.secure_rng,
                               epsilon=self.ledger.epsilon())

    def _restore(self, state_key: ClientStateKey, server_state: dict[str, Any], cache: Any) -> NodeStateFile | None:
        """Give the algorithm the server's public state and the client's own state the server continues from."""
        algorithm = self.federation.algorithm
        if server_state:
            algorithm.load_public_server_state(server_state)
        if not state_key.run_key:
            return None
        store = NodeStateFile(self.settings.ledger_dir, state_key.run_key, self.client_id, cache)
        state = store.load(state_key.client_round)
        optimizer = {k: v for k, v in state.items() if k.startswith(_LOCAL_OPTIMIZER)}
        algorithm.import_client_state(self.client_id, {k: v for k, v in state.items() if k not in optimizer})
        self.federation.client.local_optimizer_states.set_entry(
            self.client_id, {k[len(_LOCAL_OPTIMIZER):]: v for k, v in optimizer.items()})
        return store

    def train(self, params: torch.Tensor, round_idx: int, broadcast: dict[str, float],
              loss_bounds: dict[str, float], state_key: ClientStateKey | None = None,
              server_state: dict[str, Any] | None = None, cache: Any = None) -> ClientUpdate | str:
        """One round: the upload (already charged to the ledger), or the reason this client refuses.

        Args:
            params: the global model ``w_t``.
            round_idx: the round ``t`` (0-based), which names the client's random streams.
            broadcast: the algorithm's public scalars of the round (``F̄_t``).
            loss_bounds: the client's loss-clip bound per loss-release callback (class name).
            state_key: which saved client state to continue from (run key, the client's last
                round the server received); the state after this round is saved under it.
            server_state: the algorithm's public server state (``Algorithm.public_server_state``).
            cache: the node's Flower ``context.state`` (a copy of the client state), or None.
        """
        fed, cid = self.federation, self.client_id
        fed.current_round = round_idx
        store = self._restore(state_key or ClientStateKey(), server_state or {}, cache)
        fed.algorithm.configure_round(round_idx)  # round-dependent planning (e.g. a clustered selection round)
        self.planned = fed.planned_dp_events(cid)
        reason = self.ledger.refusal(self.planned)
        if reason is not None:
            logger.warning("%s", reason)
            return reason
        for cb in self.callbacks:
            bound = loss_bounds.get(type(cb).__name__)
            if bound is not None and isinstance(getattr(cb, "bounds", None), dict):
                cb.bounds[cid] = bound  # public post-processing of the client's earlier releases
        with torch.no_grad():
            vector_to_parameters(params.clone(), trainable(fed.global_model))  # w_t (global-loss releases)
        update = fed.train_client(cid, RoundContext(round=round_idx, broadcast=dict(broadcast)), params)
        if store is not None:
            optimizer = fed.client.local_optimizer_states.entry(cid)  # local_optimizer_state: kept
            store.save(round_idx, {**fed.algorithm.export_client_state(cid),
                                   **{_LOCAL_OPTIMIZER + k: v for k, v in optimizer.items()}})
        logger.info("client %d: round %d released (epsilon %.4f of %s)", cid, round_idx + 1, self.ledger.epsilon(),
                    self.ledger.target_epsilon)
        return update

    def fit_start_release(self) -> tuple[list[tuple[str, DPEvent]], dict[str, torch.Tensor]]:
        """The client's one-off release before training (``Algorithm.fit_start_release``), charged
        to its ledger (fsynced) before it is computed.

        Raises:
            PrivacyBudgetError: the release would take the client past its target ε.
        """
        fed, cid = self.federation, self.client_id
        events = fed.algorithm.fit_start_events(cid)
        reason = self.ledger.refusal(events)
        if reason is not None:
            raise PrivacyBudgetError(reason)
        self.ledger.charge(fed.start_round, events, self.run, models=fed.algorithm.covered_models())
        return events, checked_one_off_release(fed.algorithm, fed, cid, events)

    def evaluate(self, params: torch.Tensor, splits: tuple[str, ...], state_key: ClientStateKey | None = None,
                 server_state: dict[str, Any] | None = None, cache: Any = None) -> dict[str, tuple[float, float, float]]:
        """``(correct, count, loss_sum)`` of the client's evaluation model on each of its ``splits``.

        The evaluation model is the algorithm's for this client (``evaluation_groups`` of the
        released model ``params``): ``params`` itself, or the client's personal or cluster model
        (from its saved state, ``state_key``, and the public ``server_state``).
        """
        fed, dm, cid = self.federation, self.datamodule, self.client_id
        readers = {"test": dm.client_test, "train": dm.client_train, "val": dm.client_val}
        unknown = [s for s in splits if s not in readers]
        require(not unknown, f"cannot evaluate splits {unknown}; known: {sorted(readers)}")
        self._restore(state_key or ClientStateKey(), server_state or {}, cache)
        own = next(p for members, p in fed.algorithm.evaluation_groups(params, self.settings.num_partitions)
                   if cid in members)
        model = fed._load_eval(own)  # noqa: SLF001 - the federation's scratch evaluation model
        offsets = fed.algorithm.evaluation_logit_offsets()  # e.g. the client's label-prior correction
        if offsets is not None:
            offsets = offsets[cid:cid + 1]
        out: dict[str, tuple[float, float, float]] = {}
        for split in splits:
            x, y = readers[split](cid)
            counts = evaluate_clientwise(model, fed.client.per_sample_loss, x, y, torch.zeros_like(y), 1,
                                         fed.eval_batch_size, logit_offsets=offsets)
            correct, count, loss_sum = (float(counts[k].reshape(-1)[0]) for k in ("correct", "count", "loss_sum"))
            out[split] = (correct, count, loss_sum)
        return out

    def close(self) -> None:
        """Close the ledger file."""
        self.ledger.close()

