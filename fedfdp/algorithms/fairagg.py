"""Loss-weighted aggregation of FedFDP's uploads: server-side fairness that costs no extra ε.

FedFDP's fair factor ``min(1 + λΔ_j, C/‖g_j‖)`` acts inside each client's DP-SGD step and is
masked by the clip bound whenever per-sample gradients are larger than ``C/(1 + λΔ_j)``, which
at the paper's ``C = 0.1`` is every sample (docs/results/index.md). This module moves the fairness
pressure to the server: each client's model is weighted by its *released* noisy loss ``F̃_i``
(the :class:`callbacks.NoisyLossReporting` upload that FedFDP already makes every round).

Weights. With ``p_i = |D_i| / Σ_k |D_k|`` (FedFDP's weights) and ``F̃_i`` the round's release,

* ``fair_weight_rule="exp"`` (default; exponential tilting, Li et al., TERM, ICLR 2021):
  ``p̃_i ∝ |D_i| · exp(t · F̃_i)``, ``t = tilt ≥ 0``;
* ``fair_weight_rule="power"`` (q-FFL / AFL style, Li et al. ICLR 2020; Mohri et al. 2019):
  ``p̃_i ∝ |D_i| · max(F̃_i, f_min)^q``, ``q = q_fair ≥ 0``, ``f_min = loss_floor > 0``;

normalised to sum to 1 and mixed with the size weights for stability,

    π_i = (1 − mix) · p̃_i + mix · p_i,      w_{t+1} = Σ_i π_i w_{t+1}^i.

``t = 0`` (or ``q = 0``, or ``mix = 1``) gives ``π_i = p_i`` exactly, i.e. FedFDP bit for bit.
``t → ∞`` puts all weight on the client with the largest reported loss (AFL's min-max). Since
every client starts from ``w_t``, this is ``w_t − Σ_i π_i (w_t − w_{t+1}^i)``: the clients whose
released loss is high move the model more.

Why ``exp`` is the default: the weights depend only on differences ``F̃_i − F̃_k``, so a common
offset (the downward bias of clipping losses to ``[0, C_l]``, the shared noise-free part of
``F̄``) changes nothing, a noisy negative ``F̃_i`` needs no floor, and the release noise ``ξ_i``
enters as a bounded multiplicative factor ``exp(t ξ_i)``. When the release carries no
information (every ``F̃_i ≈ 0``, as after the paper's adaptive loss bound has collapsed, spec
§1.4) ``exp`` falls back to FedFDP's weights, whereas ``power`` amplifies the ratio of two
near-zero noisy numbers. ``power`` is scale-invariant instead (multiplying every loss by a
constant changes nothing), which is q-FFL's property.

Privacy. The weights are a deterministic function of ``F̃_i`` and ``|D_i|`` only. ``F̃_i`` is
already released under DP and charged to client ``i``'s ledger by ``NoisyLossReporting`` (one
SGM(q, σ_l) per round, Theorem 2's second mechanism); ``|D_i|`` is public, as in the paper's
``p_i``. The aggregate is then post-processing of the released models and losses, so the run
charges exactly FedFDP's DP events and spends exactly its ε (no new release, no new event).
Note the cost in utility instead: client ``i``'s model carries noise of std ``∝ σC/(q|D_i|)``,
so weights that move mass towards small clients raise the noise of the aggregate; ``mix`` bounds
that (``π_i ≥ mix · p_i``).

The informativeness of ``F̃_i`` depends on the loss release's bound rule. Under the paper's
``paper_adaptive`` rule the bound ``C_l^{i,t+1} = max(0, F̃_i)`` only drifts down and ``F̃_i`` with
it (measured on FashionMNIST: at ``C = 1`` most bounds sit at the 1e-3 floor by round 30; at the
paper's ``C = 0.1`` ``F̄`` is 0.57 after 100 rounds against a test loss of 1.4), so
``configs/fmnist_fedfdp_fairagg.yaml`` uses the ``fixed`` rule (``C_l`` kept at 2.5), which has
the same privacy cost (one SGM(q, σ_l) per round either way).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from fedfdp.aggregate import aggregation_weights
from fedfdp.algorithms.fedavg import FedAvg
from fedfdp.algorithms.fedfair import InitialLoss
from fedfdp.algorithms.fedfdp import FedFDP
from fedfdp.errors import require
from fedfdp.privacy.clipping import FairClipMode
from fedfdp.privacy.sample_level import SampleLevelDP
from fedfdp.types import ClientUpdate, RoundContext

FairWeightRule = Literal["exp", "power"]
FAIR_WEIGHT_RULES: tuple[str, ...] = ("exp", "power")
DEFAULT_STRENGTH = 1.0
"""``tilt`` (``exp``) or ``q_fair`` (``power``) when left unset."""


def fair_aggregation_weights(num_examples: Sequence[int], losses: Sequence[float], *,
                             rule: FairWeightRule = "exp", tilt: float = 0.0, q_fair: float = 0.0,
                             mix: float = 0.0, loss_floor: float = 1e-3) -> list[float]:
    """``π_i = (1 − mix) p̃_i + mix p_i`` with ``p̃_i ∝ |D_i| g(F̃_i)`` (see the module docstring).

    With no fairness pressure (``tilt = 0`` for ``exp``, ``q_fair = 0`` for ``power``, or
    ``mix = 1``) the result is :func:`~fedfdp.aggregate.aggregation_weights` itself, float for float.

    >>> fair_aggregation_weights([1, 1], [0.0, math.log(3.0)], rule="exp", tilt=1.0)
    [0.25, 0.75]
    >>> fair_aggregation_weights([1, 3], [0.5, 2.0], rule="exp", tilt=0.0)
    [0.25, 0.75]
    """
    sizes = aggregation_weights(num_examples)
    strength = tilt if rule == "exp" else q_fair
    if strength == 0 or mix == 1:
        return sizes
    if rule == "exp":  # shifted by the maximum: exp(t(F̃_i − max F̃)) ∈ (0, 1], no overflow
        top = max(losses)
        factors = [math.exp(tilt * (f - top)) for f in losses]
    else:  # divided by the maximum: (F̃_i / max F̃)^q ∈ (0, 1], no overflow
        floored = [max(f, loss_floor) for f in losses]
        top = max(floored)
        factors = [(f / top) ** q_fair for f in floored]
    raw = [n * g for n, g in zip(num_examples, factors)]
    total = sum(raw)  # ≥ the largest client's |D_i| · 1 > 0
    fair = [r / total for r in raw]
    if mix == 0:
        return fair
    return [(1.0 - mix) * f + mix * p for f, p in zip(fair, sizes)]


def weighted_sum(vectors: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """``Σ_i π_i v_i`` (the same accumulation as :func:`~fedfdp.aggregate.weighted_mean`)."""
    out = torch.zeros_like(vectors[0])
    for w, v in zip(weights, vectors):
        out.add_(v, alpha=w)
    return out


class FairAggregation:
    """Mixin: aggregation weights from the released losses ``F̃_i`` (module docstring).

    Placed before a DP algorithm whose run has :class:`callbacks.NoisyLossReporting`; it changes
    only :meth:`aggregate` and adds the weights' spread to :meth:`on_round_end`'s metrics.
    """

    fair_weight_rule: FairWeightRule
    tilt: float
    q_fair: float
    mix: float
    loss_floor: float

    def _init_fair_weights(self, rule: str, tilt: float | None, q_fair: float | None, mix: float,
                           loss_floor: float) -> None:
        require(rule in FAIR_WEIGHT_RULES,
                f"algorithm.fair_weight_rule must be one of {list(FAIR_WEIGHT_RULES)}, got {rule!r}")
        require(rule == "exp" or tilt is None,
                f"algorithm.tilt applies only to fair_weight_rule 'exp' (got tilt={tilt} with rule {rule!r}); "
                f"use q_fair")
        require(rule == "power" or q_fair is None,
                f"algorithm.q_fair applies only to fair_weight_rule 'power' (got q_fair={q_fair} with rule "
                f"{rule!r}); use tilt")
        tilt = (DEFAULT_STRENGTH if tilt is None else tilt) if rule == "exp" else 0.0
        q_fair = (DEFAULT_STRENGTH if q_fair is None else q_fair) if rule == "power" else 0.0
        require(math.isfinite(tilt) and tilt >= 0, f"algorithm.tilt must be finite and >= 0, got {tilt}")
        require(math.isfinite(q_fair) and q_fair >= 0, f"algorithm.q_fair must be finite and >= 0, got {q_fair}")
        require(0 <= mix <= 1, f"algorithm.mix must be in [0, 1], got {mix}")
        require(math.isfinite(loss_floor) and loss_floor > 0,
                f"algorithm.loss_floor must be finite and > 0, got {loss_floor}")
        self.fair_weight_rule = rule  # type: ignore[assignment]
        self.tilt = float(tilt)
        self.q_fair = float(q_fair)
        self.mix = float(mix)
        self.loss_floor = float(loss_floor)

    def fair_weights(self, updates: list[ClientUpdate]) -> list[float]:
        """The round's ``π_i`` from the uploads' ``num_examples`` and released ``reported_loss``."""
        missing = [u.client_id for u in updates if u.reported_loss is None]
        if missing:
            raise RuntimeError(f"clients {missing} reported no loss; fair aggregation needs NoisyLossReporting")
        return fair_aggregation_weights([u.num_examples for u in updates],
                                        [float(u.reported_loss) for u in updates],  # type: ignore[arg-type]
                                        rule=self.fair_weight_rule, tilt=self.tilt, q_fair=self.q_fair,
                                        mix=self.mix, loss_floor=self.loss_floor)

    def aggregate(self, global_params: Tensor, updates: list[ClientUpdate], context: RoundContext) -> Tensor:
        """``Σ_i π_i w_{t+1}^i`` (post-processing of the released models and losses)."""
        return weighted_sum([u.params for u in updates], self.fair_weights(updates))

    def on_round_end(self, updates: list[ClientUpdate], context: RoundContext) -> dict[str, float]:
        """The parent's metrics plus the spread of ``π``: max, min, max/min, max over size weight, n_eff."""
        metrics = dict(super().on_round_end(updates, context))  # type: ignore[misc]
        weights = self.fair_weights(updates)
        sizes = aggregation_weights([u.num_examples for u in updates])
        metrics["fair_weight_max"] = max(weights)
        metrics["fair_weight_min"] = min(weights)
        metrics["fair_weight_ratio"] = max(weights) / min(weights) if min(weights) > 0 else math.inf
        metrics["fair_weight_max_over_size"] = max(w / p for w, p in zip(weights, sizes))
        metrics["fair_weight_neff"] = 1.0 / sum(w * w for w in weights)  # effective number of clients
        return metrics


class FedFDPFairAgg(FairAggregation, FedFDP):
    """FedFDP whose server weights each client by its released noisy loss (no extra ε).

    Args:
        fair_weight_rule: ``exp`` (default, ``p̃_i ∝ |D_i| exp(t F̃_i)``) or ``power``
            (``p̃_i ∝ |D_i| max(F̃_i, loss_floor)^q_fair``).
        tilt: ``t ≥ 0`` of the ``exp`` rule (0: FedFDP; unset: 1). Refused with ``power``.
        q_fair: ``q ≥ 0`` of the ``power`` rule (0: FedFDP; unset: 1). Refused with ``exp``.
        mix: weight of the size weights ``p_i`` in ``π_i = (1 − mix) p̃_i + mix p_i``, in [0, 1].
        loss_floor: ``f_min > 0`` of the ``power`` rule (noisy losses can be ≤ 0).
        fairness_weight, fair_clip_mode, initial_broadcast_loss, lr, privacy: as for :class:`FedFDP`.
    """

    def __init__(self, *, fair_weight_rule: FairWeightRule = "exp", tilt: float | None = None,
                 q_fair: float | None = None, mix: float = 0.0, loss_floor: float = 1e-3,
                 fairness_weight: float = 0.1, fair_clip_mode: FairClipMode = "symmetric",
                 initial_broadcast_loss: InitialLoss = 0.0, lr: float = 1.0,
                 privacy: SampleLevelDP | None = None) -> None:
        super().__init__(fairness_weight=fairness_weight, fair_clip_mode=fair_clip_mode,
                         initial_broadcast_loss=initial_broadcast_loss, lr=lr, privacy=privacy)
        self._init_fair_weights(fair_weight_rule, tilt, q_fair, mix, loss_floor)


class DPFedAvgFairAgg(FairAggregation, FedAvg):
    """DP-FedAvg plus FedFDP's noisy loss release, aggregated by the released losses (no fair clip).

    The loss release is charged as in FedFDP (:class:`callbacks.NoisyLossReporting`), so its ε is
    FedFDP's; with ``tilt = 0`` its model is DP-FedAvg's.

    Args:
        fair_weight_rule, tilt, q_fair, mix, loss_floor: as for :class:`FedFDPFairAgg`.
        lr: as for :class:`FedAvg` (default 1.0, the paper's DP runs').
        privacy: the mechanism, required (:class:`fedfdp.privacy.SampleLevelDP`).
    """

    runs_without_privacy = False
    required_callbacks = ("callbacks.RDPAccounting", "callbacks.NoisyLossReporting")

    def __init__(self, *, fair_weight_rule: FairWeightRule = "exp", tilt: float | None = None,
                 q_fair: float | None = None, mix: float = 0.0, loss_floor: float = 1e-3, lr: float = 1.0,
                 privacy: SampleLevelDP | None = None) -> None:
        super().__init__(lr=lr, privacy=privacy)
        self._init_fair_weights(fair_weight_rule, tilt, q_fair, mix, loss_floor)
