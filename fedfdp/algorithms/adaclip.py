"""Bounded adaptive clipping: DP-FedAvg whose clip bound tracks a quantile of the per-sample gradient norms.

Zhao, Rehn, Heikkilä, Tajeddine & Honkela (2025, arXiv 2506.01396, "Mitigating Disparate Impact
of Differentially Private Learning through Bounded Adaptive Clipping") keep the quantile-based
adaptive clipping of Andrew, Thakkar, McMahan & Ramaswamy (NeurIPS 2021, "Differentially Private
Learning with Adaptive Clipping") but hold the bound inside ``[C_min, C_max]``: unbounded, the
bound shrinks to the tiny gradients of a well-fitted majority and suppresses the hard samples
(their Fig. 1); bounded, they report worst-class accuracy over 10 points above unbounded adaptive
clipping and 5 points above constant clipping on Skewed MNIST and FashionMNIST.

Mechanism (client ``i``, one DP-SGD step on a Poisson batch ``B`` of rate ``q``, at the bound
``C`` in force; the equations are numbered here, the papers' own references are given beside them):

    s_j   = min(1, C / ‖g_j‖)                                          flat clip                      (A1)
    G_i   = Σ_{j∈B} s_j g_j + N(0, (σ_Δ C)² I)                         the model release              (A2)
    b̃_i   = Σ_{j∈B} (1[‖g_j‖ ≤ C] − 1/2) + N(0, σ_b²)                  the centred count release      (A3)
    f̃     = min(1, max(0, b̃_i / (q|D_i|) + 1/2))                       noisy unclipped fraction       (A4)
    f̃     = min(1, max(0, Σ_i b̃_i / (τ Σ_i q|D_i|) + 1/2))             pooled over a round's uploads  (A4')
    C    ← min(C_max, max(C_min, C · exp(−η_C (f̃ − γ))))               bounded geometric update       (A5)

(A3)-(A5) are Andrew et al.'s quantile estimator with the geometric update (their Sec. 2.1 and
Algorithm 1, where the server sums the clients' noisy bits as in (A4'); TensorFlow Privacy's
``QuantileEstimatorQuery``), with Zhao et al.'s bounds ``[C_min, C_max]`` in (A5). γ is the target
unclipped quantile (0.5: the median norm), η_C the bound's learning rate (both papers: 0.2), τ
the local steps per round (``b̃_i`` then sums the client's τ counts). The local step is

    w ← w − (η / C) · G_i / n      (``normalized_clipping: true``, default; Zhao et al.'s code)    (A6)
    w ← w − η · G_i / n            (``normalized_clipping: false``; Andrew et al.)

with ``n`` the divisor of ``normalize_by`` (q|D_i| by default). In (A6) each sample contributes
``clip_C(g_j) / C`` (norm ≤ 1) and the noise is ``N(0, σ_Δ² I)``: the bound sets how samples are
weighted against each other (those with ``‖g_j‖ ≥ C`` fully, those below by ``‖g_j‖/C``), not
the step size. Dividing by ``C`` is post-processing (``C`` is public, below), so both forms have
the same privacy.

Design choices.

* **Which bound: ``bound_scope: global`` (default) or ``client``.** Zhao et al. train one
  centralised model, so their single bound is that of one dataset; they do not specify a
  federated variant. Their fairness argument is that a bound kept high enough lets the samples
  with large gradients (the hard, minority ones) keep their full weight against the small
  gradients of a well-fitted majority. Across clients under Dir(0.1) label skew the "minority"
  is a client whose labels the model serves badly, and its gradients are the large ones. One
  bound shared by all clients, adapted on the server from the sum of their noisy counts (A4'),
  keeps that argument across clients: a well-fitted client's samples fall below ``C`` and are
  damped, a badly served client's are not. A bound per client, adapted from the client's own
  counts after each of its steps (A4), normalises every client to its own median norm and so
  removes the cross-client weighting; it is kept as an option (and was measured,
  docs/results/index.md). Either way, the bounds are post-processing of released counts; the server
  updates them from the gathered uploads (so several processes, :mod:`fedfdp.distributed`, hold
  the same bounds), keeps them in :meth:`state_dict` (a checkpoint resumes them exactly) and
  broadcasts them with each round in the :class:`~fedfdp.types.RoundContext`, as FedFDP
  broadcasts its ``F̄_t``: a client keeps no state between rounds.
* **The count is centred** (``b_j − 1/2`` rather than ``b_j``), as Andrew et al. and TensorFlow
  Privacy do: adding or removing one record changes (A3) by exactly 1/2, so the count's noise
  multiplier is ``2σ_b`` rather than ``σ_b``. The fractions (A4)/(A4') divide by the expected
  batch sizes ``q|D_i|``, which are public; the realised ``|B|`` (Opacus' ``AdaClipDPOptimizer``
  divides by it) would be an unnoised release of the batch size.

Privacy. Under add/remove-one neighbours, for every step:

1. The bound ``C`` of a step is a function of ``C_0``, ``γ, η_C, C_min, C_max, q, τ`` and the
   ``|D_i|`` (public) and of noisy counts ``b̃`` of earlier steps or rounds only (already
   released), never of the current batch. Given the history, (A1) bounds each record's
   contribution by ``‖s_j g_j‖ ≤ C`` and (A3)'s by ``|b_j − 1/2| = 1/2``.
2. ``count_accounting: split`` (default; Andrew et al. Theorem 1). The model noise is raised to
   ``σ_Δ = (σ^{-2} − (2σ_b)^{-2})^{-1/2}`` (needs ``2σ_b > σ``). Scale the two releases by the
   public constants ``σ / (σ_Δ C)`` and ``σ / σ_b``: both then carry ``N(0, σ² I)`` noise, and
   one record's joint contribution ``(s_j g_j σ/(σ_Δ C), (b_j − 1/2) σ/σ_b)`` has squared norm
   ``≤ σ² (σ_Δ^{-2} + (2σ_b)^{-2}) = σ² · σ^{-2} = 1``. The pair (A2)+(A3) is therefore, up to a
   public invertible scaling, ``Σ_{j∈B} f(x_j) + N(0, σ² I)`` with ``‖f‖ ≤ 1`` on one Poisson
   sample: exactly one SGM(q, σ). The ledger charges exactly DP-FedAvg's event per step, and the
   run spends exactly DP-FedAvg's ε at the configured σ (``tests/algorithms/test_adaclip.py`` checks this).
3. ``count_accounting: separate``: the model keeps ``σ`` and the count is charged as its own
   event SGM(q, 2σ_b) (kind ``clip_count``) per step; by composition ε is strictly larger than
   DP-FedAvg's.
4. Everything derived from the releases (``f̃``, the next bound, the step ``η/C``, the
   logged ``clip_bound_*`` and ``unclipped_fraction_noisy``) is post-processing. The exact
   clipped fraction (``client_clipped_fraction``) remains a simulation-only diagnostic.

``σ_b = 0`` would release the exact count: ``split`` refuses it in the constructor
(``2σ_b > σ``), ``separate`` declares it in :meth:`dp_releases`, which
:class:`callbacks.RDPAccounting` refuses at start (as it refuses σ = 0 on the model update). ``adaptive: false`` is DP-FedAvg with constant
clipping at ``C_0`` and step ``η/C_0`` (normalised), bit for bit: no count, no extra event.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Literal

import torch

from fedfdp.algorithms.fedavg import FedAvg
from fedfdp.client import ClientModule
from fedfdp.errors import require
from fedfdp.privacy.accounting import DPEvent
from fedfdp.privacy.adaptive_clipping import (CountingFlatClip, next_clip_bound, split_noise_multiplier,
                                              unclipped_fraction_estimate)
from fedfdp.privacy.release import noisy_count_release
from fedfdp.privacy.validation import DPRelease
from fedfdp.privacy.sample_level import SampleLevelDP
from fedfdp.privacy.sampling import drawn_rate
from fedfdp.seeding import RandomSource
from fedfdp.privacy.uploads import POST_PROCESSING
from fedfdp.types import MODEL_RELEASE, ClientData, ClientUpdate, LocalBatch, LocalStep, RoundContext, StepOutput

CountAccounting = Literal["split", "separate"]
COUNT_ACCOUNTINGS: tuple[str, ...] = ("split", "separate")
CLIP_COUNT_RELEASE = "clip_count"
"""Kind of the ledger entry of a separately charged unclipped-count release (``count_accounting: separate``)."""
BoundScope = Literal["global", "client"]
BOUND_SCOPES: tuple[str, ...] = ("global", "client")
BOUND_KEY = "adaclip_bound"
"""``ClientUpdate.extras`` key of the client's clip bound after its local update (``bound_scope: client``)."""
COUNT_KEY = "adaclip_count"
"""``ClientUpdate.extras`` key of the sum of the client's released noisy centred counts ``b̃`` of the round."""


class DPFedAvgAdaClip(FedAvg):
    """DP-FedAvg with bounded adaptive clipping (module docstring, (A1)-(A6)).

    Args:
        adaptive: adapt the bounds (false: constant clipping at ``C_0``, DP-FedAvg bit for bit
            with step ``η/C_0`` when ``normalized_clipping``; no count is released).
        bound_scope: ``global`` (one bound shared by all clients, updated by the server from the
            sum of the round's noisy counts, (A4')) or ``client`` (each client's own bound, updated
            after each of its steps from its own count, (A4)).
        target_quantile: γ in [0, 1], the target fraction of unclipped samples (both papers: 0.5).
        clip_lr: η_C ≥ 0, the bound's geometric learning rate (both papers: 0.2).
        min_clip_bound: C_min > 0, Zhao et al.'s lower bound (≤ ``max_grad_norm``).
        max_clip_bound: C_max < ∞ (≥ ``max_grad_norm``).
        count_noise_std: σ_b, the std of the noise on each centred count (A3); the count's noise
            multiplier is 2σ_b. Andrew et al. suggest about (expected count) / 20.
        count_accounting: ``split`` (σ_Δ from σ and σ_b, one SGM(q, σ) per step; needs
            ``2σ_b > σ``) or ``separate`` (σ on the model plus an SGM(q, 2σ_b) per step).
        normalized_clipping: step ``η/C`` (A6; Zhao et al.'s code) instead of ``η``.
        lr: as for :class:`FedAvg` (default 1.0).
        privacy: the mechanism, required (:class:`fedfdp.privacy.SampleLevelDP`): its ``max_grad_norm``
            is C_0, the initial bound, its ``noise_multiplier`` σ, the noise multiplier of the step's
            (combined, with ``split``) release.
    """

    runs_without_privacy = False

    def __init__(self, *, adaptive: bool = True, bound_scope: BoundScope = "global", target_quantile: float = 0.5,
                 clip_lr: float = 0.2, min_clip_bound: float = 0.1, max_clip_bound: float = 100.0,
                 count_noise_std: float = 10.0, count_accounting: CountAccounting = "split",
                 normalized_clipping: bool = True, lr: float = 1.0, privacy: SampleLevelDP | None = None) -> None:
        super().__init__(lr=lr, privacy=privacy)
        max_grad_norm, noise_multiplier = self.mechanism.max_grad_norm, self.mechanism.noise_multiplier
        require(isinstance(adaptive, bool), f"algorithm.adaptive must be true or false, got {adaptive!r}")
        require(bound_scope in BOUND_SCOPES,
                f"algorithm.bound_scope must be one of {list(BOUND_SCOPES)}, got {bound_scope!r}")
        require(0 <= target_quantile <= 1, f"algorithm.target_quantile must be in [0, 1], got {target_quantile}")
        require(math.isfinite(clip_lr) and clip_lr >= 0, f"algorithm.clip_lr must be finite and >= 0, got {clip_lr}")
        require(0 < min_clip_bound <= max_grad_norm,
                f"algorithm.min_clip_bound must be in (0, privacy.max_grad_norm={max_grad_norm}], got {min_clip_bound}")
        require(max_grad_norm <= max_clip_bound < math.inf,
                f"algorithm.max_clip_bound must be finite and >= privacy.max_grad_norm={max_grad_norm}, got {max_clip_bound}")
        require(count_accounting in COUNT_ACCOUNTINGS,
                f"algorithm.count_accounting must be one of {list(COUNT_ACCOUNTINGS)}, got {count_accounting!r}")
        require(math.isfinite(count_noise_std) and count_noise_std >= 0,
                f"algorithm.count_noise_std must be finite and >= 0, got {count_noise_std}")
        if adaptive and count_accounting == "split" and noise_multiplier > 0:  # σ = 0 is refused at start
            require(2 * count_noise_std > noise_multiplier,
                    f"algorithm.count_noise_std must be > privacy.noise_multiplier/2 = {noise_multiplier / 2:g} with "
                    f"count_accounting 'split' (Andrew et al. Theorem 1), got {count_noise_std}; raise it or use "
                    f"count_accounting 'separate'")
        self.adaptive = adaptive
        self.bound_scope = bound_scope
        self.target_quantile = float(target_quantile)
        self.clip_lr = float(clip_lr)
        self.min_clip_bound = float(min_clip_bound)
        self.max_clip_bound = float(max_clip_bound)
        self.count_noise_std = float(count_noise_std)
        self.count_accounting = count_accounting
        self.normalized_clipping = normalized_clipping
        self.global_bound = float(max_grad_norm)  # C (bound_scope global)
        self.bounds: dict[int, float] = {}  # C_i after the client's last update (bound_scope client); absent: C_0
        self._num_clients = 0  # set in setup: the bound statistics cover every client

    # ---- the bound --------------------------------------------------------------------------
    @property
    def model_noise_multiplier(self) -> float:
        """The noise multiplier of the model release (A2): σ_Δ with ``split``, else σ."""
        if self.adaptive and self.count_accounting == "split" and self.mechanism.noise_multiplier > 0:
            return split_noise_multiplier(self.mechanism.noise_multiplier, self.count_noise_std)
        return self.mechanism.noise_multiplier

    def bound(self, client_id: int) -> float:
        """The bound client ``client_id`` clips its next step at: the global ``C`` or its own ``C_i``."""
        if self.bound_scope == "global":
            return self.global_bound
        return self.bounds.get(client_id, self.mechanism.max_grad_norm)

    @staticmethod
    def bound_key(client_id: int) -> str:
        """The :class:`RoundContext` broadcast key of client ``client_id``'s bound."""
        return f"clip_bound/{client_id}"

    def configure_round(self, round_idx: int) -> RoundContext:
        """Broadcast the bounds of the round (public: post-processing of released counts): ``clip_bound``
        (global scope) or ``clip_bound/<i>`` for every client (client scope)."""
        context = super().configure_round(round_idx)
        if self.bound_scope == "global":
            bounds = {"clip_bound": self.global_bound}
        else:
            bounds = {self.bound_key(cid): self.bound(cid) for cid in range(self._num_clients)}
        return replace(context, broadcast={**context.broadcast, **bounds})

    def round_bound(self, client_id: int, context: RoundContext) -> float:
        """The bound client ``client_id`` starts the round at, as broadcast in ``context`` (a client holds
        no state of its own: its bound comes with the round, like ``w_t``)."""
        key = "clip_bound" if self.bound_scope == "global" else self.bound_key(client_id)
        return float(context.broadcast.get(key, self.bound(client_id)))

    def next_bound(self, bound: float, unclipped_fraction: float) -> float:
        """(A5) with this algorithm's γ, η_C, C_min and C_max."""
        return next_clip_bound(bound, unclipped_fraction, target_quantile=self.target_quantile, clip_lr=self.clip_lr,
                               min_bound=self.min_clip_bound, max_bound=self.max_clip_bound)

    # ---- privacy ----------------------------------------------------------------------------
    def planned_dp_events(self, client_id: int, dataset_size: int) -> list[tuple[str, DPEvent]]:
        """Per round: ``local_steps`` SGM(q, σ) (``split``, count included), or those plus ``local_steps``
        SGM(q, 2σ_b) of kind ``clip_count`` (``separate``)."""
        events = super().planned_dp_events(client_id, dataset_size)
        if self.adaptive and self.count_accounting == "separate" and self.count_noise_std > 0:
            events.append((CLIP_COUNT_RELEASE, DPEvent(noise_multiplier=2.0 * self.count_noise_std,
                                                       sample_rate=self.mechanism.sample_rate, steps=self.local_steps)))
        return events

    def dp_releases(self) -> list[DPRelease]:
        """The model update, charged at σ (with ``split`` it is the pair (A2)+(A3), one SGM(q, σ); the model
        part alone carries σ_Δ > σ), clip ``C ≤ C_max``; and, when adaptive, the centred count (noise σ_b,
        sensitivity 1/2: noise multiplier 2σ_b)."""
        if not self.adaptive:
            return super().dp_releases()  # DP-FedAvg's: clip C_0, noise σ C_0
        model = DPRelease(name="model update", noise_field="algorithm.privacy.noise_multiplier",
                          noise_multiplier=self.mechanism.noise_multiplier, bound_field="algorithm.max_clip_bound",
                          clip_bound=self.max_clip_bound)
        return [model, DPRelease(name="unclipped-count release", noise_field="algorithm.count_noise_std",
                                 noise_multiplier=2.0 * self.count_noise_std,
                                 bound_field="the centred count's per-record bound", clip_bound=0.5,
                                 kind=self._count_kind())]

    def _count_kind(self) -> str:
        """The DP event kind that charges the noisy count: the step's own event with ``split`` (Andrew
        et al. Theorem 1: one SGM(q, σ) covers the pair), its own ``clip_count`` event with ``separate``."""
        return MODEL_RELEASE if self.count_accounting == "split" else CLIP_COUNT_RELEASE

    def upload_privacy(self) -> dict[str, str | None]:
        """The model; when adaptive, the noisy count (its release) and the client's next bound
        (computed from released counts: post-processing)."""
        fields = dict(super().upload_privacy())
        if self.adaptive:
            fields[f"extras.{COUNT_KEY}"] = self._count_kind()
            fields[f"extras.{BOUND_KEY}"] = POST_PROCESSING
        return fields

    # ---- client half ------------------------------------------------------------------------
    def step_batch(self, data: ClientData, bound: float, generator: RandomSource) -> LocalBatch:
        """One private step's input at bound ``C = bound``: a Poisson batch (the next draw of
        ``generator``), flat counting clip (A1), noise std ``σ_Δ C`` (A2), step ``η/C`` or ``η`` (A6)."""
        batch = self.mechanism.private_batch(data, CountingFlatClip(bound), generator,
                                             self.lr / bound if self.normalized_clipping else self.lr)
        batch.noise_multiplier = self.model_noise_multiplier  # σ_Δ of the split release (A2), charged jointly
        return batch

    def release_count(self, batch: LocalBatch, data: ClientData) -> float:
        """(A3): the centred count of the step just taken on ``batch``, noised with ``σ_b`` drawn from the
        step's generator (its draw after the step's model noise)."""
        rule, generator = batch.clip_rule, batch.generator
        assert isinstance(rule, CountingFlatClip) and generator is not None
        # sensitivity 1/2 (a record moves the centred count by 1/2): noise multiplier 2σ_b; on the
        # step's own sample, so with ``split`` accounting the pair is one joint SGM(q, σ)
        return noisy_count_release(rule.unclipped - 0.5 * rule.size, noise_std=self.count_noise_std, sensitivity=0.5,
                                   generator=generator, device=data.y.device, kind=self._count_kind(),
                                   sample_rate=drawn_rate(batch.x, batch.y), sample=batch)

    def expected_count(self, dataset_size: int) -> float:
        """``q|D_i|``, the public divisor of (A4)."""
        return max(self.mechanism.sample_rate * dataset_size, 1e-12)

    def local_step(self, context: RoundContext) -> LocalStep:
        """``local_steps`` private steps, each followed by its count release (A3); with ``bound_scope:
        client`` the client's bound is updated (A4)-(A5) after every step.

        Per client: the round's bound first (at its first batch), then for each step its batch at
        the current bound, the step, and the step's count released from the client's generator
        after the step's model noise (at the next step's batch, or at the upload for the last one,
        so the draws keep that order on every scheduler), then :meth:`adaptive_update`.
        """
        state: dict[int, dict[str, Any]] = {}  # per client: bound, bounds used, counts, last batch

        def release_pending(data: ClientData) -> None:
            """The count of the step just taken (A3) and, client scope, the next bound (A4)-(A5)."""
            own = state[data.client_id]
            last, own["last"] = own["last"], None
            if last is None or not self.adaptive:
                return
            own["counts"].append(self.release_count(last, data))
            if self.bound_scope == "client":
                own["bound"] = self.next_bound(own["bound"], unclipped_fraction_estimate(
                    own["counts"][-1], self.expected_count(data.size)))

        def batch(data: ClientData, generator: RandomSource) -> LocalBatch:
            if data.client_id not in state:
                state[data.client_id] = {"bound": self.round_bound(data.client_id, context), "used": [], "counts": [],
                                         "last": None}
            release_pending(data)
            own = state[data.client_id]
            own["last"] = self.step_batch(data, own["bound"], generator)
            own["used"].append(own["bound"])
            return own["last"]

        def update(client: ClientModule, data: ClientData, outputs: list[StepOutput]) -> ClientUpdate:
            release_pending(data)
            own = state.pop(data.client_id)
            return self.adaptive_update(client, data, outputs, own["used"], own["counts"], own["bound"])

        return LocalStep(batch=batch, update=lambda client, data, output: update(client, data, [output]),
                         sample_rate=self.mechanism.sample_rate, steps=self.local_steps, update_steps=update)

    def adaptive_update(self, client: ClientModule, data: ClientData, outputs: list[StepOutput], used: list[float],
                        counts: list[float], bound: float) -> ClientUpdate:
        """DP-FedAvg's upload plus the released counts and (client scope) the new bound in ``extras``,
        and the diagnostics: the bound used and the client's own noisy unclipped fraction."""
        update = self.client_update(client, data, outputs)
        update.diagnostics["clip_bound"] = sum(used) / len(used)
        if counts:
            update.extras[COUNT_KEY] = torch.tensor(sum(counts), dtype=torch.float64)
            update.diagnostics["unclipped_fraction_noisy"] = sum(
                unclipped_fraction_estimate(c, self.expected_count(data.size)) for c in counts) / len(counts)
        if self.bound_scope == "client":
            update.extras[BOUND_KEY] = torch.tensor(bound, dtype=torch.float64)
        return update

    # ---- server half ------------------------------------------------------------------------
    def on_round_end(self, updates: list[ClientUpdate], context: RoundContext) -> dict[str, float]:
        """Update the bounds from the uploads: ``global`` (A4')-(A5) from the summed counts, ``client``
        by keeping each client's new ``C_i``. Logs the bound statistics over all clients (the bound
        each will clip its next step at) and, ``global``, the pooled noisy unclipped fraction."""
        metrics = dict(super().on_round_end(updates, context))
        counted = [u for u in updates if COUNT_KEY in u.extras]
        if self.bound_scope == "global" and counted:
            total = sum(float(u.extras[COUNT_KEY]) for u in counted)
            expected = self.local_steps * sum(self.expected_count(u.num_examples) for u in counted)
            fraction = unclipped_fraction_estimate(total, expected)
            self.global_bound = self.next_bound(self.global_bound, fraction)
            metrics["unclipped_fraction_noisy"] = fraction
        for update in updates:
            if BOUND_KEY in update.extras:
                self.bounds[update.client_id] = float(update.extras[BOUND_KEY])
        known = [self.bound(cid) for cid in range(self._num_clients or max(len(updates), 1))]
        metrics["clip_bound_mean"] = sum(known) / len(known)
        metrics["clip_bound_min"] = min(known)
        metrics["clip_bound_max"] = max(known)
        return metrics

    def setup(self, federation: Any) -> None:
        """Note the number of clients (the bound statistics cover clients not yet sampled)."""
        super().setup(federation)
        self._num_clients = int(federation.num_clients)

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The global bound and every client's bound."""
        return {**super().state_dict(), "global_bound": self.global_bound, "bounds": dict(self.bounds)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the clip bounds."""
        super().load_state_dict(state)
        self.global_bound = float(state["global_bound"])
        self.bounds = {int(k): float(v) for k, v in state["bounds"].items()}
