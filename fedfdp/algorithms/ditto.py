"""Ditto (Li, Hu, Beirami, Smith, ICML 2021): a global model plus personalised models.

Each round client ``i`` (1) updates the global model exactly as the parent algorithm
(FedAvg / DP-FedAvg) and uploads it, and (2) updates its personal model ``v_i`` — kept on the
client in a :class:`ClientStateStore`, started from ``w_t`` at its first round — with the same
local loop on ``F_i(v) + (λ/2)‖v − w_t‖²``: the term ``λ(v − w_t)`` is added after
privatisation. Each client is evaluated with its personal model (clients that never trained
use ``w_t``). λ = 0 makes ``v_i`` plain local training.

Under DP two threat models are offered (:class:`DPDitto`'s ``private_personal``):

- ``True`` (default): the personal steps are DP-SGD steps too and are charged to the client's
  ledger, so the personal model is itself (ε, δ)-DP and may be deployed or shared; a round costs
  twice the steps of DP-FedAvg.
- ``False``: silo-specific sample-level DP (Liu, Hu, Smith et al., "On Privacy and
  Personalization in Cross-Silo Federated Learning", NeurIPS 2022, the DP-Ditto of their §4):
  only the global update leaves the client, so only it is clipped, noised and charged; the
  personal model is trained with plain SGD on the client's own data and must never leave that
  client (it is as private as the raw data it was trained on). ε then covers everything the
  server sees.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from fedfdp.algorithms.client_state import ClientStateStore
from fedfdp.algorithms.dpfedavg import DPFedAvg
from fedfdp.algorithms.fedavg import FedAvg, LocalMode
from fedfdp.algorithms.grad_terms import TermClient
from fedfdp.errors import require
from fedfdp.privacy.accounting import DPEvent
from fedfdp.privacy.release import NormalizeBy
from fedfdp.seeding import RandomSource, poisson_mask, select_rows
from fedfdp.types import ClientData, ClientUpdate, LocalBatch, RoundContext


def personal_generator(generator: RandomSource) -> RandomSource:
    """The personal phase's stream, drawn from the round's client generator before any step.

    A non-reproducible (secure) source is used as is.
    """
    if not isinstance(generator, torch.Generator):
        return generator
    seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator, device=generator.device))
    gen = torch.Generator(device=generator.device)
    gen.manual_seed(seed)
    return gen


class _Ditto:
    supports_distributed = False  # per-client state kept by local_update (see Algorithm)

    private_personal = True

    def _init_ditto(self, personal_weight: float) -> None:
        require(personal_weight >= 0, f"algorithm.personal_weight must be >= 0, got {personal_weight}")
        self.personal_weight = personal_weight
        self.client_state = ClientStateStore()  # v_i

    def personal_update(self, client: Any, data: ClientData, context: RoundContext,
                        generator: RandomSource) -> ClientUpdate:
        """The personal phase's local loop on ``client`` (the parent's, unless overridden)."""
        return super().local_update(client, data, context, generator)  # type: ignore[misc]

    def local_update(self, client: Any, data: ClientData, context: RoundContext,
                     generator: RandomSource) -> ClientUpdate:
        """Global update (uploaded), then the personal update (kept on the client)."""
        personal_gen = personal_generator(generator)
        start = client.get_flat_params()
        update = super().local_update(client, data, context, generator)  # type: ignore[misc]
        personal = self.client_state.get(data.client_id, "personal", lambda: start.clone())
        client.set_flat_params(personal)
        lam = self.personal_weight
        wrapped = TermClient(client, lambda v: lam * (v - start))
        with client.local_optimizer_for(data.client_id, "personal"):  # its own optimizer state, not w_t's
            personal_update = self.personal_update(wrapped, data, context, personal_gen)
        self.client_state.set(data.client_id, "personal", personal_update.params)
        # exactly the round's events: the parent's steps once per charged phase (each phase's own
        # upload already lists this class's planned events, i.e. both phases: adding them would
        # charge every step twice)
        update.dp_events = list(self.planned_dp_events(data.client_id, data.size))
        return update

    def planned_dp_events(self, client_id: int, dataset_size: int) -> list[tuple[str, DPEvent]]:
        """The parent's events twice (global and personal steps), once when the personal model is
        kept private by the client (``private_personal=False``)."""
        events = list(super().planned_dp_events(client_id, dataset_size))  # type: ignore[misc]
        return 2 * events if self.private_personal else events

    def evaluation_groups(self, global_params: Tensor, num_clients: int) -> list[tuple[list[int], Tensor]]:
        """Each client with a personal model evaluates it; the others use ``w_t``."""
        return self.client_state.evaluation_groups("personal", global_params, num_clients)

    def state_dict(self) -> dict[str, Any]:
        """The personal models."""
        return {"clients": self.client_state.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the personal models."""
        self.client_state.load_state_dict(state["clients"])


class Ditto(_Ditto, FedAvg):
    """Non-private Ditto.

    Args:
        personal_weight: λ ≥ 0 of the personal objective (spec §6: 0.1 or 1).
        lr, local_epochs, batch_size, local_mode, sample_rate: as for :class:`FedAvg` (shared by both
            phases).
    """


    def __init__(self, *, personal_weight: float = 0.1, lr: float = 0.1, local_epochs: int = 1,
                 batch_size: int = 64, local_mode: LocalMode = "epoch", sample_rate: float = 0.05) -> None:
        super().__init__(lr=lr, local_epochs=local_epochs, batch_size=batch_size, local_mode=local_mode,
                         sample_rate=sample_rate)
        self._init_ditto(personal_weight)


class DPDitto(_Ditto, DPFedAvg):
    """Ditto with DP-SGD on the global model; the personal phase private too (default) or kept on the client.

    Args:
        personal_weight: λ ≥ 0.
        lr, sample_rate, max_grad_norm, noise_multiplier, local_steps, normalize_by,
            normalize_constant: as for :class:`DPFedAvg`.
        private_personal: ``True``: the personal steps are DP-SGD steps and charged (the personal
            model is (ε, δ)-DP). ``False``: the personal model never leaves the client, so its
            ``local_steps`` plain SGD steps (Poisson batches of rate q, mean gradient, step
            ``personal_lr``) release nothing and are not charged (silo-specific sample-level DP,
            Liu et al. 2022; see the module docstring).
        personal_lr: the personal phase's step size; ``None``: ``lr`` (required when
            ``private_personal=False``, since a clipped step and a plain one need different sizes).
        personal_steps: plain SGD steps of the personal phase per round (``None``: ``local_steps``);
            only with ``private_personal=False``, where they cost no ε, only compute.
    """

    def __init__(self, *, personal_weight: float = 0.1, lr: float = 1.0, sample_rate: float = 0.05,
                 max_grad_norm: float = 0.1, noise_multiplier: float = 2.0, local_steps: int = 1,
                 normalize_by: NormalizeBy = "expected", normalize_constant: float = 64.0,
                 private_personal: bool = True, personal_lr: float | None = None,
                 personal_steps: int | None = None) -> None:
        super().__init__(lr=lr, sample_rate=sample_rate, max_grad_norm=max_grad_norm,
                         noise_multiplier=noise_multiplier, local_steps=local_steps, normalize_by=normalize_by,
                         normalize_constant=normalize_constant)
        self._init_ditto(personal_weight)
        require(private_personal or personal_lr is not None,
                "algorithm.personal_lr is required with private_personal: false (a plain SGD step size, e.g. 0.05)")
        require(personal_lr is None or personal_lr > 0, f"algorithm.personal_lr must be > 0, got {personal_lr}")
        require(personal_steps is None or (personal_steps >= 1 and not private_personal),
                f"algorithm.personal_steps must be >= 1 and needs private_personal: false (private personal steps "
                f"take local_steps), got {personal_steps}")
        # the proximal term's step v ← v − lr·λ(v − w_t) overshoots and grows when lr·λ > 2
        lr_personal = lr if personal_lr is None else personal_lr
        require(lr_personal * personal_weight < 2, f"algorithm.personal_lr × personal_weight = "
                f"{lr_personal:g} × {personal_weight:g} = {lr_personal * personal_weight:g} must be < 2 (the "
                f"proximal step overshoots and the personal model diverges); lower either")
        self.private_personal = bool(private_personal)
        # the personal models are evaluated: covered by ε only when their steps are charged
        self.evaluated_models_covered = self.private_personal
        self.personal_lr = lr if personal_lr is None else personal_lr
        self.personal_steps = local_steps if personal_steps is None else personal_steps

    def personal_update(self, client: Any, data: ClientData, context: RoundContext,
                        generator: RandomSource) -> ClientUpdate:
        """DP-SGD steps (charged), or plain SGD steps that never leave the client (``private_personal=False``)."""
        if self.private_personal:  # DPFedAvg's local loop with the personal step size
            rule = self.clip_rule(context)
            outputs = [client.training_step(dataclasses.replace(self.private_batch(data, rule, generator),
                                                                lr=self.personal_lr))
                       for _ in range(self.local_steps)]
            return self.client_update(client, data, outputs)
        losses = []
        for _ in range(self.personal_steps):
            mask = poisson_mask(data.size, self.sample_rate, generator)
            if bool(mask.any()):
                x, y = select_rows(mask, data.x, data.y)
                losses.append(client.training_step(LocalBatch(x=x, y=y, lr=self.personal_lr)).loss)
        return ClientUpdate(client_id=data.client_id, params=client.get_flat_params(), num_examples=data.size,
                            diagnostics={"personal_train_loss": sum(losses) / len(losses)} if losses else {})
