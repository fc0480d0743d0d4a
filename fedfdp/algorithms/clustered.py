"""Clustered DP federated learning: M cluster models trained by local DP-SGD (RC-DPFL spec §1, §6).

:class:`ClusteredDPFL` is the shared machinery of RC-DPFL and its clustered baselines:

* **State** (checkpointed by :meth:`state_dict`): the cluster models ``θ_1..θ_M`` (an ``M × p``
  tensor) and every client's assignment ``R(i)``.
* **Client half**: client i starts from ``θ_{R(i)}`` (:meth:`client_start_params`), optionally
  re-selects its cluster (:meth:`_select`, IFCA / RC-DPFL stage C), then runs K local epochs of
  DP-SGD (spec §1.2) given by its privacy mechanism, ``privacy=EpochDPSGD(...)``
  (:class:`fedfdp.privacy.EpochDPSGD`): ``⌊N_i/b⌋`` steps per epoch on Poisson batches of rate
  ``q = b/N_i``, per-sample flat clipping at c, ``N(0, (c z_i)² I)`` on the clipped sum, division by
  the expected batch size ``b``. A full-batch round (RC-DPFL round 1, q = 1) accumulates the clipped
  sum over physical chunks and draws the noise once per epoch (Appendix E). Every step is the
  engine's private step, :meth:`fedfdp.client.ClientModule.training_step` on the mechanism's
  :meth:`~fedfdp.privacy.EpochDPSGD.private_batch` (the maths is written out there).
* **Server half**: ``θ_m ← Σ_{i∈S_m} (N_i / Σ_{j∈S_m} N_j) θ_i`` over the clients that trained
  cluster m this round (= ``θ_m + Σ w_i Δ_i``; an empty cluster keeps its model).
  :meth:`aggregate` returns the ``N_i``-weighted mean of *all* uploads as the federation's
  "global" model: a diagnostic only, never evaluated (evaluation uses one group per cluster).
* **Privacy**: one noise multiplier z_i per client for the whole run, either given or calibrated
  by the mechanism in :meth:`setup` so that the full schedule (:meth:`planned_schedule`) meets the
  target ε at the accountant's δ (:mod:`fedfdp.privacy.schedule`). The schedule is round-dependent, so
  :meth:`planned_dp_events` returns the events of the round configured last.

Its subclasses live in their own modules: RC-DPFL, IFCA, KM-CDPFL, and the oracle and local
baselines (:mod:`fedfdp.algorithms.cdpfl_baselines`).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils import parameters_to_vector

from fedfdp.aggregate import weighted_mean
from fedfdp.algorithms.base import Algorithm
from fedfdp.client import trainable
from fedfdp.errors import ConfigError, require
from fedfdp.privacy.accounting import DPEvent
from fedfdp.privacy.epoch_dpsgd import EpochDPSGD
from fedfdp.privacy.release import exponential_selection
from fedfdp.privacy.schedule import selection_event
from fedfdp.privacy.validation import DPRelease
from fedfdp.privacy.uploads import POST_PROCESSING
from fedfdp.types import MODEL_RELEASE, ClientData, ClientUpdate, LocalBatch, LocalStep, RoundContext, StepOutput

if TYPE_CHECKING:
    from fedfdp.client import ClientModule
    from fedfdp.interfaces import FederationView

logger = logging.getLogger(__name__)

SELECTION_RELEASE = "selection"
"""Kind of the DP event of a private cluster selection (exponential mechanism)."""

Selection = Literal["private", "loss"]


class ClusteredDPFL(Algorithm):
    """M cluster models, local DP-SGD, size-weighted per-cluster averaging (base class).

    Args:
        num_clusters: M, the number of cluster models.
        lr: local learning rate η_l.
        privacy: the local DP-SGD, :class:`fedfdp.privacy.EpochDPSGD` (batch size b, local epochs K,
            clip c, z or the target ε its z_i are calibrated to over the whole schedule of
            ``model.num_rounds`` rounds); required: the family runs privately only.
        physical_batch_size: chunk size of the per-sample passes of a DP-SGD step (the full-batch
            round's gradient accumulation, ``LocalBatch.physical_batch_size``) and of the loss
            evaluations (memory only; results depend on it only through float summation order).
    """

    required_callbacks = ("callbacks.RDPAccounting",)
    #: Each evaluated model is a cluster model: an average of charged DP-SGD uploads, grouped by
    #: cluster indices that are public (the server's) or charged selections. With ``selection:
    #: loss`` the indices are not private, and ``dp_valid`` (hence the claim) is false.
    evaluated_models_covered: ClassVar[bool] = True
    released_models: ClassVar[str] = "clusters"
    full_batch_first_round: ClassVar[bool] = False

    def __init__(self, *, num_clusters: int = 4, lr: float = 0.1, privacy: EpochDPSGD | None = None,
                 physical_batch_size: int = 256) -> None:
        require(num_clusters >= 1, f"algorithm.num_clusters must be >= 1, got {num_clusters}")
        require(lr > 0, f"algorithm.lr must be > 0, got {lr}")
        if not isinstance(privacy, EpochDPSGD):
            raise ConfigError(f"{type(self).__name__} is private: algorithm.privacy must be a "
                              f"fedfdp.privacy.EpochDPSGD, got {'null' if privacy is None else type(privacy).__name__}")
        require(physical_batch_size >= 1, f"algorithm.physical_batch_size must be >= 1, got {physical_batch_size}")
        self.num_clusters = num_clusters
        self.lr = lr
        self.privacy = privacy
        self.physical_batch_size = physical_batch_size
        self.selection: Selection | None = None  # set by algorithms that select clusters by loss
        self.selection_epsilon: float | None = None
        self.selection_rounds: int | None = None
        self.cluster_models = torch.zeros(0)
        self.assignment = np.zeros(0, dtype=np.int64)
        self.client_sizes: list[int] = []  # N_i, set in setup
        self.seed, self.num_rounds = 0, 0
        self._round: int | None = None

    @property
    def batch_size(self) -> int:
        """The mechanism's expected batch size b (its rates ``q_i = b/N_i``)."""
        return self.privacy.batch_size

    @property
    def planned_epsilon(self) -> float | None:
        """The largest ε a client's whole schedule spends (the mechanism's, after :meth:`setup`)."""
        return self.privacy.planned_epsilon

    # ---- set-up and privacy planning ------------------------------------------------------------
    def _init_selection(self, selection: Selection, selection_epsilon: float | None,
                        selection_rounds: int | None) -> None:
        require(selection in ("private", "loss"), f"algorithm.selection must be 'private' or 'loss', got {selection!r}")
        require(selection_epsilon is None or selection_epsilon > 0,
                f"algorithm.selection_epsilon must be > 0 or null, got {selection_epsilon}")
        require(selection_rounds is None or selection_rounds >= 1,
                f"algorithm.selection_rounds must be >= 1 or null, got {selection_rounds}")
        self.selection, self.selection_epsilon, self.selection_rounds = selection, selection_epsilon, selection_rounds

    def setup(self, federation: FederationView) -> None:
        """Fix the schedule, calibrate or check z_i against the budget, initialise the models."""
        name = type(self).__name__
        require(federation.num_rounds is not None,
                f"model.num_rounds must be set for {name}: its privacy schedule is planned for a fixed round count")
        self.num_rounds, self.seed = int(federation.num_rounds), int(federation.seed)
        accountant = federation.accountant
        own_target = self.privacy.target_epsilon
        target = own_target if own_target is not None else accountant.target_epsilon
        if self.selection == "private":
            if self.selection_epsilon is None:
                require(target is not None, "algorithm.selection_epsilon must be set when no target_epsilon is given")
                self.selection_epsilon = 0.03 * float(target)  # spec A6: ε_sel = 0.03 ε_total
            if self.selection_rounds is None:
                self.selection_rounds = max(1, self.num_rounds // 10)
        sizes = [int(s) for s in federation.datamodule.train_sizes]
        self.client_sizes = sizes
        self.privacy.resolve_noise(sizes, self.planned_schedule, target_epsilon=target, delta=accountant.delta,
                                   orders=accountant.orders,
                                   limits=[("algorithm.privacy.target_epsilon", own_target),
                                           ("RDPAccounting.target_epsilon", accountant.target_epsilon)])
        zs = self.privacy.client_noise_multipliers
        logger.info("%s: z_i in [%.4f, %.4f], planned epsilon %.4f over %d rounds at delta %g", name, zs.min(),
                    zs.max(), self.planned_epsilon, self.num_rounds, accountant.delta)
        initial = parameters_to_vector(trainable(federation.global_model)).detach()
        self.cluster_models = self.initial_models(initial, federation)
        self.assignment = self.initial_assignment(federation)

    def dp_releases(self) -> list[DPRelease]:
        """The local DP-SGD model update (z_i after calibration) and, with ``selection: loss``, the
        seed's unnoised cluster selection (an argmin of training losses: no guarantee)."""
        releases = self.privacy.releases()
        if self.selection == "loss":
            releases.append(DPRelease(
                name="cluster selection (argmin of training losses)", noise_field="algorithm.selection=loss: noise",
                noise_multiplier=0.0, bound_field="algorithm.selection", clip_bound=math.inf, kind=SELECTION_RELEASE,
                fix="use algorithm.selection: private, or set RDPAccounting.allow_non_private: true to run the "
                    "seed's unaccounted selection for analysis"))
        return releases

    def upload_privacy(self) -> dict[str, str | None]:
        """The DP-SGD model and the cluster index: the server's assignment (public), or in a selection
        round the private selection's output (charged as a ``selection`` event), both public or
        charged; with ``selection: loss`` the index is an unnoised argmin of training losses."""
        return {"params": MODEL_RELEASE, "extras.cluster": None if self.selection == "loss" else POST_PROCESSING}

    def initial_models(self, initial: Tensor, federation: FederationView) -> Tensor:
        """``M × p`` initial cluster models: all equal to ``θ^init`` by default."""
        return initial.unsqueeze(0).repeat(self.num_clusters, 1)

    def initial_assignment(self, federation: FederationView) -> np.ndarray:
        """``R^1``: every client in cluster 0 by default (the models are equal)."""
        return np.zeros(federation.num_clients, dtype=np.int64)

    def is_full_batch(self, round_idx: int) -> bool:
        """Whether round ``round_idx`` (0-based) trains on the full local batch (q = 1)."""
        return self.full_batch_first_round and round_idx == 0

    def selection_stage_start(self) -> int | None:
        """First round with loss-based selection (None: none, or not known yet)."""
        return None

    def selects(self, round_idx: int) -> bool:
        """Whether clients (re)select their cluster at the start of ``round_idx``."""
        start = self.selection_stage_start()
        if self.selection is None or start is None or round_idx < start:
            return False
        return self.selection == "loss" or round_idx < start + int(self.selection_rounds or 0)

    def planned_schedule(self, noise_multiplier: float, dataset_size: int) -> list[DPEvent]:
        """Every DP event of a whole run for a client of size ``dataset_size`` (for calibration)."""
        def event(full: bool) -> DPEvent:
            return self.privacy.round_event(noise_multiplier, dataset_size, full)
        first = 1 if self.full_batch_first_round else 0
        events = [event(True)] * first + [event(False).repeated(self.num_rounds - first)]
        if self.selection == "private":
            events.append(selection_event(float(self.selection_epsilon)).repeated(
                min(int(self.selection_rounds or 0), self.num_rounds)))
        return events

    def round_events(self, round_idx: int | None, client_id: int, dataset_size: int) -> list[tuple[str, DPEvent]]:
        """The ``(kind, event)`` pairs client ``client_id`` spends in round ``round_idx``.

        ``round_idx=None``: a normal round's training events only (no full batch, no selection).
        """
        full = round_idx is not None and self.is_full_batch(round_idx)
        events = [(MODEL_RELEASE, self.privacy.round_event(self.privacy.client_noise(client_id), dataset_size, full))]
        if round_idx is not None and self.selection == "private" and self.selects(round_idx):
            events.insert(0, (SELECTION_RELEASE, selection_event(float(self.selection_epsilon))))
        return events

    def planned_dp_events(self, client_id: int, dataset_size: int) -> list[tuple[str, DPEvent]]:
        """Events of the round configured last, so ``RDPAccounting``'s per-round guard projects the true round.

        Before the first round (budget planning by ``RDPAccounting.max_rounds``, which assumes equal
        rounds): a normal round's training events only, so that planning never cuts the run below
        ``num_rounds``; the whole round-dependent schedule was checked against the target in ``setup``.
        """
        return self.round_events(self._round, client_id, dataset_size)

    # ---- server half ----------------------------------------------------------------------------
    def configure_round(self, round_idx: int) -> RoundContext:
        """Remember the round (the DP events depend on it)."""
        self._round = round_idx
        return RoundContext(round=round_idx)

    def client_start_params(self, client_id: int, global_params: Tensor, context: RoundContext) -> Tensor:
        """``θ_{R(i)}``, the model of the client's assigned cluster."""
        # built in setup (or restored) before the module is on its device: follow the global model
        self.cluster_models = self.cluster_models.to(global_params.device)
        return self.cluster_models[int(self.assignment[client_id])]

    def cluster_labels(self, updates: list[ClientUpdate], context: RoundContext) -> list[int] | None:
        """Which cluster each upload is averaged into (None: keep every cluster model)."""
        return [int(u.extras["cluster"]) for u in updates]

    def update_clusters(self, updates: list[ClientUpdate], labels: list[int]) -> None:
        """``θ_m ←`` size-weighted mean of the uploads labelled m; assignments follow the labels."""
        for m in sorted(set(labels)):
            members = [u for u, label in zip(updates, labels) if label == m]
            self.cluster_models[m] = weighted_mean([u.params for u in members], [u.num_examples for u in members])
        for u, label in zip(updates, labels):
            self.assignment[u.client_id] = label

    def aggregate(self, global_params: Tensor, updates: list[ClientUpdate], context: RoundContext) -> Tensor:
        """Per-cluster averaging; returns the size-weighted mean of all uploads (diagnostic "global")."""
        labels = self.cluster_labels(updates, context)
        if labels is not None:
            self.update_clusters(updates, labels)
        return weighted_mean([u.params for u in updates], [u.num_examples for u in updates])

    def on_round_end(self, updates: list[ClientUpdate], context: RoundContext) -> dict[str, float]:
        """Log how many clusters hold at least one client."""
        return {"clusters_used": float(len(np.unique(self.assignment)))}

    def evaluation_groups(self, global_params: Tensor, num_clients: int) -> list[tuple[list[int], Tensor]]:
        """One group per non-empty cluster: its clients are evaluated with its model."""
        self.cluster_models = self.cluster_models.to(global_params.device)
        return [(np.flatnonzero(self.assignment == m).tolist(), self.cluster_models[m])
                for m in range(len(self.cluster_models)) if np.any(self.assignment == m)]

    def cluster_assignment(self) -> np.ndarray:
        """Every client's current cluster ``R(i)`` (a copy)."""
        return self.assignment.copy()

    # ---- client half ----------------------------------------------------------------------------
    def local_step(self, context: RoundContext) -> LocalStep:
        """(Select a cluster,) then K epochs of DP-SGD from its model, written once for every scheduler.

        Per client: the cluster selection first (its evaluations and charged draw from the client's
        generator; the start model is the chosen cluster's, else the assigned one's), then its own
        ``K·⌊N_i/b⌋`` steps on Poisson batches (K steps on all N_i records in a full-batch round),
        each :meth:`ClientModule.training_step` on :meth:`private_batch`, then the upload with the
        cluster index and the round's DP events. A full-batch round (its chunked accumulation) runs
        per client only.
        """
        full = self.is_full_batch(context.round)
        clusters: dict[int, int] = {}

        def start(client: ClientModule, data: ClientData, generator: torch.Generator) -> Tensor:
            cluster = int(self.assignment[data.client_id])
            if self.selects(context.round):
                cluster = self._select(client, data, generator)
            clusters[data.client_id] = cluster
            return self.cluster_models[cluster]

        def update(client: ClientModule, data: ClientData, outputs: list[StepOutput]) -> ClientUpdate:
            return self._upload(client, data, context, clusters.pop(data.client_id), [o.loss for o in outputs])

        return LocalStep(
            batch=lambda data, generator: self.private_batch(data, full, generator),
            update=lambda client, data, output: update(client, data, [output]),
            sample_rate=1.0 if full else self.privacy.sample_rate(max(1, min(self.client_sizes, default=1))),  # largest q_i
            steps=1,
            update_steps=update, start=start,
            expected_batch=lambda n: n if full else self.privacy.sample_rate(n) * n,
            client_steps=lambda data: self.privacy.steps(data.size, full), stackable=not full)

    def _upload(self, client: ClientModule, data: ClientData, context: RoundContext, cluster: int,
                losses: list[float]) -> ClientUpdate:
        """The client's upload: its model, the round's DP events and its cluster index."""
        return ClientUpdate(client_id=data.client_id, params=client.get_flat_params(), num_examples=data.size,
                            dp_events=self.round_events(context.round, data.client_id, data.size),
                            diagnostics={"train_loss": float(np.mean(losses)) if losses else 0.0},
                            extras={"cluster": torch.tensor(cluster)})

    def private_batch(self, data: ClientData, full_batch: bool, generator: torch.Generator) -> LocalBatch:
        """One DP-SGD step's input for client i: the mechanism's
        (:meth:`fedfdp.privacy.EpochDPSGD.private_batch`, where the maths is written out) at this
        algorithm's learning rate and physical chunk size."""
        return self.privacy.private_batch(data, full_batch, generator, lr=self.lr,
                                          physical_batch_size=self.physical_batch_size)

    @torch.no_grad()
    def _select(self, client: ClientModule, data: ClientData, generator: torch.Generator) -> int:
        """The client's cluster: argmin of its train loss (``loss``) or the exponential mechanism (``private``).

        Private: argmax_m of train accuracy in % plus Gumbel(0, 2·(100/(N_i − 1))/ε_sel) (spec A6).
        """
        losses, accuracies = [], []
        for model in self.cluster_models:
            client.set_flat_params(model)
            loss, correct = 0.0, 0
            for start in range(0, data.size, self.physical_batch_size):
                x, y = data.x[start:start + self.physical_batch_size], data.y[start:start + self.physical_batch_size]
                out = client.net(x)
                loss += float(client.per_sample_loss(out, y).sum())
                correct += int((out.argmax(1) == y).sum())
            losses.append(loss / data.size)
            accuracies.append(100.0 * correct / data.size)
        if self.selection == "loss":
            return int(np.argmin(losses))
        return exponential_selection(torch.tensor(accuracies, dtype=torch.float64),
                                     sensitivity=100.0 / max(data.size - 1, 1), epsilon=float(self.selection_epsilon),
                                     generator=generator, kind=SELECTION_RELEASE)

    # ---- state ----------------------------------------------------------------------------------
    def public_server_state(self) -> dict[str, Any]:
        """The whole server state (:meth:`state_dict`): cluster models (means of released models) and
        assignments (from the released cluster indices or the server's clustering of released
        updates), which a client reads to start, select and be evaluated."""
        return self.state_dict()

    def load_public_server_state(self, state: dict[str, Any]) -> None:
        """Take the server's cluster models and assignments."""
        self.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        """Cluster models and assignments (z_i are recomputed by the mechanism in ``setup``)."""
        return {"cluster_models": self.cluster_models.clone(), "assignment": self.assignment.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.cluster_models = state["cluster_models"].clone()
        self.assignment = np.asarray(state["assignment"], dtype=np.int64)

