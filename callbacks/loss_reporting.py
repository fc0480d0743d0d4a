"""Loss reporting: the scalar each client uploads with its model (FedFair / FedFDP).

:class:`LossReporting` uploads the exact training loss of the local model (non-private FedFair,
Alg. 1). :class:`NoisyLossReporting` is FedFDP's private release (J Eq. 14-15, Alg. 2): losses
of the updated local model on a fresh Poisson sample, clipped to ``[0, C_l^{i,t}]``, summed,
noised with ``N(0, (σ_l C_l^{i,t})²)``, divided by the expected sample size, and charged to the
client's ledger as one SGM(q, σ_l) event. The next bound ``C_l^{i,t+1}`` is post-processing of
the released value (spec §1.4, A-8).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch import Trainer

from callbacks.base import FederationCallback
from fedfdp.aggregate import weighted_scalar_mean
from fedfdp.errors import ConfigError, require
from fedfdp.metrics import eval_batch_size, weighted_variance
from fedfdp.privacy.accounting import DPEvent
from fedfdp.privacy.release import LossClipRule, NormalizeBy, batch_denominator, next_loss_bound, noisy_loss_release
from fedfdp.privacy.validation import DPRelease
from fedfdp.seeding import poisson_mask, select_rows
from fedfdp.types import LOSS_RELEASE, ClientData, ClientUpdate, RoundContext

if TYPE_CHECKING:
    from fedfdp.client import ClientModule
    from fedfdp.federation import Federation


class LossReporting(FederationCallback):
    """Uploads the local model's mean training loss ``F_i(w_{t+1}^i)`` (non-private).

    Args:
        eval_batch_size: batch size of the loss pass over the client's training split (null: 128
            on CPU, 4096 on accelerators; see :func:`fedfdp.metrics.eval_batch_size`).
    """

    def __init__(self, *, eval_batch_size: int | None = None) -> None:
        require(eval_batch_size is None or eval_batch_size >= 1,
                f"LossReporting.eval_batch_size must be >= 1 or null, got {eval_batch_size}")
        self.eval_batch_size = eval_batch_size

    def upload_privacy(self, federation: Federation) -> dict[str, str | None]:
        """The exact loss leaves the client: not private."""
        return {"reported_loss": None}

    @torch.no_grad()
    def _losses(self, client: ClientModule, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        step = eval_batch_size(self.eval_batch_size, y.device)
        parts = [client.per_sample_loss(client(x[i:i + step]), y[i:i + step]) for i in range(0, y.shape[0], step)]
        return torch.cat(parts) if parts else torch.zeros(0, device=y.device)

    def on_client_update(self, trainer: Trainer, federation: Federation, client: ClientModule,
                         data: ClientData, update: ClientUpdate) -> None:
        """Set ``update.reported_loss`` to the exact mean loss over the training split."""
        loss = float(self._losses(client, data.x, data.y).mean())
        update.reported_loss = loss
        update.diagnostics["local_loss"] = loss

    def on_round_end(self, trainer: Trainer, federation: Federation, context: RoundContext,
                     updates: list[ClientUpdate], metrics: dict[str, float]) -> None:
        """Log the code-style Ψ: weighted variance of the local models' training losses."""
        local = [u.diagnostics.get("local_loss") for u in updates]
        if all(v is not None for v in local):
            weights = [u.num_examples for u in updates]
            mean = weighted_scalar_mean(local, weights)  # type: ignore[arg-type]
            metrics["psi_code"] = weighted_variance(local, weights, mean)  # type: ignore[arg-type]


class NoisyLossReporting(LossReporting):
    """FedFDP's differentially private loss upload with the adaptive clip bound.

    Args:
        loss_bound: initial clip bound ``C_l`` (paper 2.5).
        noise_multiplier: ``σ_l`` (paper 5.0); noise std on the sum is ``σ_l·C_l^{i,t}``.
        sample_rate: Poisson rate of the loss sample (None: the algorithm's q, as Theorem 4).
        loss_clip_rule: next-bound rule (spec §1.4): ``paper_adaptive`` (default), ``fixed``,
            ``scaled_adaptive``, ``floor``.
        bound_scale: κ for ``scaled_adaptive``.
        bound_floor: ``c_min`` for ``floor``.
        min_bound: a positive floor under every adaptive rule. The paper's rule drifts towards 0
            and 0 is absorbing (all losses clipped to 0, no noise, the release is 0 forever, spec
            §1.4); after a negative noisy loss it lands there at once. The default 1e-3 is about
            where the paper's rule ends after 778 rounds in the spec's simulation.
        normalize_by: ``expected`` (q|D_i|, default) or ``realized`` (the code's count; leaks it).
        eval_batch_size: batch size of the loss pass (null: by device, as :class:`LossReporting`).
    """

    def __init__(self, *, loss_bound: float = 2.5, noise_multiplier: float = 5.0,
                 sample_rate: float | None = None, loss_clip_rule: LossClipRule = "paper_adaptive",
                 bound_scale: float = 1.5, bound_floor: float = 0.1, min_bound: float = 1e-3,
                 normalize_by: Literal["expected", "realized"] = "expected", eval_batch_size: int | None = None) -> None:
        super().__init__(eval_batch_size=eval_batch_size)
        require(0 < loss_bound < math.inf, f"NoisyLossReporting.loss_bound must be finite and > 0, got {loss_bound}")
        require(0 < noise_multiplier < math.inf,
                f"NoisyLossReporting.noise_multiplier must be finite and > 0, got {noise_multiplier}")
        require(0 < bound_scale < math.inf, f"NoisyLossReporting.bound_scale must be finite and > 0, got {bound_scale}")
        require(0 <= bound_floor < math.inf, f"NoisyLossReporting.bound_floor must be finite and >= 0, got {bound_floor}")
        require(0 < min_bound <= loss_bound,
                f"NoisyLossReporting.min_bound must be in (0, loss_bound={loss_bound}], got {min_bound}")
        require(sample_rate is None or 0 < sample_rate <= 1,
                f"NoisyLossReporting.sample_rate must be in (0, 1] or null, got {sample_rate}")
        rules = LossClipRule.__args__  # type: ignore[attr-defined]
        require(loss_clip_rule in rules, f"NoisyLossReporting.loss_clip_rule must be one of {list(rules)}, "
                                         f"got {loss_clip_rule!r}")
        require(normalize_by in ("expected", "realized"),
                f"NoisyLossReporting.normalize_by must be 'expected' or 'realized', got {normalize_by!r}")
        self.loss_bound = loss_bound
        self.noise_multiplier = noise_multiplier
        self.sample_rate = sample_rate
        self.loss_clip_rule = loss_clip_rule
        self.bound_scale = bound_scale
        self.bound_floor = bound_floor
        self.min_bound = min_bound
        self.normalize_by: NormalizeBy = normalize_by
        self.bounds: dict[int, float] = {}  # C_l^{i,t}; clients absent still have the initial bound

    def _rate(self, federation: Federation) -> float:
        mechanism = getattr(federation.algorithm, "privacy", None)
        rate = self.sample_rate if self.sample_rate is not None else getattr(mechanism, "sample_rate", None)
        if rate is None:
            raise ConfigError("NoisyLossReporting.sample_rate must be set: the algorithm has no privacy mechanism "
                              "whose sampling rate the loss release could share")
        return float(rate)

    def bound(self, client_id: int) -> float:
        """The current clip bound ``C_l^{i,t}`` of a client."""
        return self.bounds.get(client_id, self.loss_bound)

    def dp_releases(self, federation: Federation) -> list[DPRelease]:
        """The loss upload: each loss clipped to ``[0, C_l]``, noise ``σ_l C_l``."""
        return [DPRelease(name="loss upload", noise_field="NoisyLossReporting.noise_multiplier",
                          noise_multiplier=self.noise_multiplier, bound_field="NoisyLossReporting.loss_bound",
                          clip_bound=self.loss_bound, kind=LOSS_RELEASE)]

    def upload_privacy(self, federation: Federation) -> dict[str, str | None]:
        """The reported loss is the output of the loss release (kind ``loss``)."""
        return {"reported_loss": LOSS_RELEASE}

    def planned_dp_events(self, federation: Federation, client_id: int) -> list[tuple[str, DPEvent]]:
        """One SGM(q, σ_l) per round (Theorem 2's second mechanism)."""
        return [(LOSS_RELEASE, DPEvent(noise_multiplier=self.noise_multiplier, sample_rate=self._rate(federation)))]

    def on_client_update(self, trainer: Trainer, federation: Federation, client: ClientModule,
                         data: ClientData, update: ClientUpdate) -> None:
        """Release ``F̃_i`` on a fresh Poisson sample (spec A-7) and append its DP event."""
        rate = self._rate(federation)
        gen = federation.generator("loss", federation.current_round, data.client_id)
        mask = poisson_mask(data.size, rate, gen)
        losses = self._losses(client, *select_rows(mask, data.x, data.y))
        bound = self.bound(data.client_id)
        denominator = batch_denominator(self.normalize_by, sample_rate=rate, dataset_size=data.size,
                                        realized=int(losses.shape[0]), constant=1.0)
        released = noisy_loss_release(losses, bound=bound, noise_multiplier=self.noise_multiplier,
                                      denominator=denominator, generator=gen, sample_rate=rate, kind=LOSS_RELEASE)
        update.reported_loss = released
        update.dp_events.extend(self.planned_dp_events(federation, data.client_id))
        update.diagnostics["loss_bound"] = bound
        if losses.numel():  # the code's Ψ input: raw (non-noisy) batch loss; simulation-only diagnostic
            update.diagnostics["local_loss"] = float(losses.mean())

    def on_before_aggregate(self, trainer: Trainer, federation: Federation, updates: list[ClientUpdate]) -> None:
        """Adapt each uploading client's bound from its released loss (Eq. 15; public: post-processing).

        Done here rather than at the release so that, with several processes, every process holds
        every client's bound.
        """
        for update in updates:
            assert update.reported_loss is not None
            self.bounds[update.client_id] = max(self.min_bound, next_loss_bound(
                self.loss_clip_rule, released=update.reported_loss, initial=self.loss_bound, scale=self.bound_scale,
                floor=self.bound_floor))

    def on_round_end(self, trainer: Trainer, federation: Federation, context: RoundContext,
                     updates: list[ClientUpdate], metrics: dict[str, float]) -> None:
        """Log ``psi_code`` and the mean loss clip bound."""
        super().on_round_end(trainer, federation, context, updates, metrics)
        n = federation.num_clients  # clients never sampled still hold the initial bound
        metrics["loss_bound_mean"] = (sum(self.bounds.values()) + (n - len(self.bounds)) * self.loss_bound) / n

    def state_dict(self) -> dict[str, Any]:
        """The per-client loss bounds."""
        return {"bounds": dict(self.bounds)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the per-client loss bounds."""
        self.bounds = {int(k): float(v) for k, v in state_dict["bounds"].items()}
