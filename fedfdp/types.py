"""Value objects passed between the federation loop, algorithms, clients and callbacks."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from fedfdp.errors import ConfigError
from fedfdp.seeding import RandomSource

MODEL_RELEASE = "model"
"""Kind of a DP event that privatises a model update (counted in every accounting mode)."""
LOSS_RELEASE = "loss"
"""Kind of a DP event that privatises a reported loss (FedFDP Theorem 2's second mechanism)."""
LABEL_HISTOGRAM_RELEASE = "label_histogram"
"""Kind of a DP event that privatises a client's label counts (released once, before training)."""
CLIENT_RELEASE = "client_update"
"""Kind of a DP event of the *client* unit: the server's noisy sum of the cohort's clipped model updates
(:class:`fedfdp.privacy.ClientLevelDP`), charged once a round to the population's ledger."""
POPULATION = -1
"""The ledger id of the client-unit events: they hide any one client of the whole population, so they
are charged once a round to the population, not to each client (:mod:`fedfdp.privacy.ledger`)."""


@dataclass(frozen=True, kw_only=True)
class DPEvent:
    """``steps`` repetitions of one SGM with noise multiplier σ and Poisson rate q.

    A DP-SGD step is ``DPEvent(noise_multiplier=σ, sample_rate=q)``; an unsampled Gaussian
    release (e.g. a noisy loss over the whole local set) has ``sample_rate=1.0``.

    Raises:
        ConfigError: σ not finite and > 0, q not in (0, 1], or steps not an integer ≥ 0.
    """

    noise_multiplier: float
    sample_rate: float
    steps: int = 1

    def __post_init__(self) -> None:
        s, q, n = self.noise_multiplier, self.sample_rate, self.steps
        if not _is_real(s) or not (math.isfinite(s) and s > 0):
            raise ConfigError(f"DPEvent.noise_multiplier must be a finite number > 0, got {s!r}")
        if not _is_real(q) or not 0 < q <= 1:
            raise ConfigError(f"DPEvent.sample_rate must be in (0, 1], got {q!r}")
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ConfigError(f"DPEvent.steps must be an integer >= 0, got {n!r}")

    def repeated(self, times: int) -> DPEvent:
        """The same mechanism run ``times`` as often (``steps · times``)."""
        return DPEvent(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate,
                       steps=self.steps * times)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


class ClipRule(Protocol):
    """Maps per-sample losses ``ℓ_j`` and gradient norms ``‖g_j‖`` to clip factors ``s_j``."""

    max_grad_norm: float

    def __call__(self, losses: Tensor, norms: Tensor) -> Tensor: ...


@dataclass(frozen=True)
class RoundContext:
    """What the server broadcasts to every client of a round besides the global model.

    Attributes:
        round: 0-based round index ``t``.
        broadcast: public scalars, e.g. ``{"loss": F̄_t}`` for FedFair / FedFDP.
    """

    round: int
    broadcast: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ClientData:
    """One client's private training split (on the model's device)."""

    client_id: int
    x: Tensor
    y: Tensor

    @property
    def size(self) -> int:
        """``|D_i|``, treated as public (as in the paper's weights ``p_i``)."""
        return int(self.y.shape[0])


@dataclass
class LocalBatch:
    """One local step's input for :meth:`fedfdp.client.ClientModule.training_step`.

    ``clip_rule=None`` means a non-private step on the mean loss, optionally multiplied by
    ``loss_scale(mean_loss)`` (FedFair's dynamic learning rate, Eq. 9). Otherwise the step is
    private: per-sample factors from ``clip_rule``, Gaussian noise of noise multiplier
    ``noise_multiplier`` (σ: the std σC on the sum is formed by the release, C the clip rule's
    bound), division by ``denominator``.

    ``grad_transform(params, grads) -> grads`` runs after privatisation (after noise and
    normalisation) and before the optimizer step: the place for data-independent terms such as
    FedProx's ``μ(w − w_t)`` or SCAFFOLD's ``c − c_i``. Inside the per-sample loss they would be
    clipped away (style.md §4.2); here they are post-processing and cost no privacy.

    ``sample_rate`` is the Poisson rate q the private batch was drawn at (1 for a full batch), for
    the algorithm's own bookkeeping: the mechanism records the rate at which it drew the batch's
    tensors itself (:mod:`fedfdp.privacy.sampling`), and an upload may charge only the (σ, q) its
    steps had (:mod:`fedfdp.privacy.mechanism`). A batch the mechanism did not draw matches no
    charged event.

    ``physical_batch_size = P`` bounds the memory of a private step on a large logical batch (e.g.
    a full-batch step on all ``N_i`` records): the per-sample pass runs on consecutive chunks of at
    most ``P`` records and the chunks' clipped sums are added before the one noise draw (gradient
    accumulation; :meth:`fedfdp.client.ClientModule.clipped_sum`). The release is the same as one
    pass, up to floating-point summation order. ``None``: one pass over the whole batch.
    """

    x: Tensor
    y: Tensor
    lr: float
    clip_rule: ClipRule | None = None
    noise_multiplier: float = 0.0
    denominator: float = 1.0
    generator: RandomSource | None = None
    loss_scale: Callable[[Tensor], Tensor] | None = None
    grad_transform: Callable[[list[Tensor], list[Tensor]], list[Tensor]] | None = None
    physical_batch_size: int | None = None
    sample_rate: float | None = None
    canary_sum: Tensor | None = None
    """An audit's gradient-space canaries that joined this step (flat, one entry per trainable
    parameter; each canary ``C e_j``), added to the clipped sum before the noise
    (:class:`fedfdp.privacy.sample_level.RecordCanaries`); None outside an audit."""


@dataclass
class StepOutput:
    """What one local step reports back (simulation diagnostics; never sent to the server)."""

    loss: float
    batch_size: int
    negative_fraction: float = 0.0
    clipped_fraction: float = 0.0
    factor_quantiles: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """5th, 50th and 95th percentile of the per-sample clip factors ``s_j`` of a private step."""


@dataclass
class ClientUpdate:
    """What a client uploads after its local update, plus the ledger entries of its releases.

    Attributes:
        client_id: the client ``i``.
        params: the flat local model ``w_{t+1}^i`` (already private when the step was).
        num_examples: ``|D_i|``, for the aggregation weights ``p_i``.
        dp_events: ``(kind, event)`` for every differentially private release in this update;
            the accounting callback charges them to client ``i``'s ledger.
        reported_loss: the loss value uploaded by the client (set by a loss-reporting callback;
            noisy under DP).
        diagnostics: simulation-only statistics for logging (never read by an algorithm).
        extras: algorithm-owned payload (e.g. control variates), namespaced by the algorithm.
    """

    client_id: int
    params: Tensor
    num_examples: int
    dp_events: list[tuple[str, DPEvent]] = field(default_factory=list)
    reported_loss: float | None = None
    diagnostics: dict[str, float] = field(default_factory=dict)
    extras: dict[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class StackedStepSpec:
    """An algorithm's local step, written once: the per-client, stacked and sweep rounds schedule it.

    (Also :data:`LocalStep`.) Per client (:func:`fedfdp.algorithms.base.run_local_step`): ``start``,
    then the client's steps one after another (``batch``, the private step, ...), then the upload.
    In a stacked round (:mod:`fedfdp.stacked`) and a sweep (:mod:`fedfdp.sweep`) the clients take
    the same steps in lockstep, each step of every client one engine pass; ``stackable`` False
    keeps a step the engine cannot interleave (a full-batch step accumulated in chunks) per client.

    Attributes:
        batch: ``(data, generator) -> LocalBatch``: draws the client's Poisson batch from
            ``generator`` and returns its private step's input (a fresh clip rule, lr, noise std
            ``σC``, denominator, and ``generator`` itself, from which the noise is drawn next).
        update: ``(client, data, step_output) -> ClientUpdate``: the upload once the step is
            taken (the local model is read from ``client``, the run's
            :class:`fedfdp.client.ClientModule`; plain data types import no module above them).
        sample_rate: the Poisson rate q of ``batch``; the engine passes are planned from the
            expected batch sizes ``q|D_i|`` (public), before any batch is drawn.
        steps: private steps per client (default 1). With ``steps = K > 1`` the clients take their
            steps in lockstep: step ``k`` of every client is one engine pass, each client from its
            own model after step ``k - 1``; ``batch`` is called once per step with the client's same
            generator, and ``update_steps`` makes the upload from the K step outputs.
        update_steps: ``(client, data, step_outputs) -> ClientUpdate`` for a lockstep spec (``steps
            > 1``, ``client_steps`` or ``start``); a client's outputs may be fewer than ``steps``.
        client_steps: ``data -> K_i``, each client's own step count (``steps`` is then their
            maximum): clients with fewer steps leave the lockstep passes after their last one,
            e.g. K epochs of ``⌊N_i/b⌋`` steps (:class:`~fedfdp.algorithms.clustered.ClusteredDPFL`).
        start: ``(client, data, generator) -> start model``: what a client does before its first
            step, with its own generator and inside its release's trace (e.g. a cluster selection:
            its evaluations and its charged draw), returning the flat model it steps from; run
            for every client in client order before any batch is drawn. None: the algorithm's
            ``client_start_params``.
        expected_batch: ``N_i -> expected batch size`` of a client with ``N_i`` records, for the
            planning of the engine passes (default ``q·N_i`` with q = ``sample_rate``).
        stackable: whether a stacked round may interleave the step (False: per client only).
    """

    batch: Callable[[ClientData, RandomSource], LocalBatch]
    update: Callable[[Any, ClientData, StepOutput], ClientUpdate]
    sample_rate: float
    steps: int = 1
    update_steps: Callable[[Any, ClientData, list[StepOutput]], ClientUpdate] | None = None
    client_steps: Callable[[ClientData], int] | None = None
    start: Callable[[Any, ClientData, RandomSource], Tensor] | None = None
    expected_batch: Callable[[int], float] | None = None
    stackable: bool = True

    @property
    def lockstep(self) -> bool:
        """Whether the round runs as lockstep steps (several steps, per-client counts or a start half)."""
        return self.steps > 1 or self.client_steps is not None or self.start is not None

    def steps_of(self, data: ClientData) -> int:
        """Client ``data.client_id``'s step count: ``client_steps(data)``, else ``steps``."""
        return self.steps if self.client_steps is None else int(self.client_steps(data))

    def expected_batch_size(self, num_records: int) -> float:
        """The expected Poisson batch of a client with ``num_records`` records (planning only)."""
        return self.sample_rate * num_records if self.expected_batch is None else float(self.expected_batch(num_records))


#: The algorithm's local step (:class:`StackedStepSpec`), by the name the algorithms write it under.
LocalStep = StackedStepSpec
