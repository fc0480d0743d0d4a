"""Ditto (Li, Hu, Beirami, Smith, ICML 2021): a global model plus personalised models.

Each round client ``i`` (1) updates the global model exactly as the parent algorithm
(FedAvg, private or not) and uploads it, and (2) updates its personal model ``v_i`` — kept on the
client in a :class:`ClientStateStore`, started from ``w_t`` at its first round — with the same
local loop on ``F_i(v) + (λ/2)‖v − w_t‖²``: the term ``λ(v − w_t)`` is added after
privatisation. Each client is evaluated with its personal model (clients that never trained
use ``w_t``). λ = 0 makes ``v_i`` plain local training.

Under DP (``privacy=SampleLevelDP(...)``) two threat models are offered (``private_personal``):

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
from typing import Any, ClassVar

import torch
from torch import Tensor

from fedfdp.algorithms.client_state import ClientStateStore
from fedfdp.algorithms.fedavg import FedAvg, LocalMode
from fedfdp.algorithms.grad_terms import TermClient
from fedfdp.errors import require
from fedfdp.privacy.accounting import DPEvent
from fedfdp.privacy.sample_level import SampleLevelDP
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
    """Ditto; with ``privacy``, DP-SGD on the global model and the personal phase private too (default)
    or kept on the client.

    Args:
        personal_weight: λ ≥ 0 of the personal objective (spec §6: 0.1 or 1).
        lr, local_epochs, batch_size, local_mode, sample_rate, privacy: as for :class:`FedAvg` (shared by
            both phases).
        private_personal: with ``privacy``: ``True``: the personal steps are DP-SGD steps and charged
            (the personal model is (ε, δ)-DP). ``False``: the personal model never leaves the client,
            so its ``privacy.local_steps`` plain SGD steps (Poisson batches of rate q, mean gradient,
            step ``personal_lr``) release nothing and are not charged (silo-specific sample-level DP,
            Liu et al. 2022; see the module docstring).
        personal_lr: the private run's personal step size; ``None``: ``lr`` (required when
            ``private_personal=False``, since a clipped step and a plain one need different sizes).
        personal_steps: plain SGD steps of the personal phase per round (``None``: ``privacy.local_steps``);
            only with ``private_personal=False``, where they cost no ε, only compute.
    """

    def __init__(self, *, personal_weight: float = 0.1, lr: float = 0.1, local_epochs: int = 1,
                 batch_size: int = 64, local_mode: LocalMode = "epoch", sample_rate: float = 0.05,
                 privacy: SampleLevelDP | None = None, private_personal: bool = True,
                 personal_lr: float | None = None, personal_steps: int | None = None) -> None:
        super().__init__(lr=lr, local_epochs=local_epochs, batch_size=batch_size, local_mode=local_mode,
                         sample_rate=sample_rate, privacy=privacy)
        self._init_ditto(personal_weight)
        if privacy is None:
            require(private_personal and personal_lr is None and personal_steps is None,
                    "algorithm.private_personal, personal_lr and personal_steps choose how a private run trains "
                    "its personal models: they need algorithm.privacy")
            return
        require(private_personal or personal_lr is not None,
                "algorithm.personal_lr is required with private_personal: false (a plain SGD step size, e.g. 0.05)")
        require(personal_lr is None or personal_lr > 0, f"algorithm.personal_lr must be > 0, got {personal_lr}")
        require(personal_steps is None or (personal_steps >= 1 and not private_personal),
                f"algorithm.personal_steps must be >= 1 and needs private_personal: false (private personal steps "
                f"take privacy.local_steps), got {personal_steps}")
        # the proximal term's step v ← v − lr·λ(v − w_t) overshoots and grows when lr·λ > 2
        lr_personal = lr if personal_lr is None else personal_lr
        require(lr_personal * personal_weight < 2, f"algorithm.personal_lr × personal_weight = "
                f"{lr_personal:g} × {personal_weight:g} = {lr_personal * personal_weight:g} must be < 2 (the "
                f"proximal step overshoots and the personal model diverges); lower either")
        self.private_personal = bool(private_personal)
        self.personal_lr = lr_personal
        self.personal_steps = privacy.local_steps if personal_steps is None else personal_steps

    #: The personal models are evaluated: covered by ε when their steps are charged (a private run with
    #: ``private_personal``: :meth:`covers_evaluated_models`). On the class, so that a subclass that
    #: overrides an evaluation hook loses it (fail-closed, :meth:`Algorithm.covers_evaluated_models`).
    evaluated_models_covered: ClassVar[bool] = True
    kept_models: ClassVar[str | None] = "personal"

    def covers_evaluated_models(self) -> bool:
        """The class's declaration, for a private run whose personal steps are charged."""
        return self.privacy is not None and self.private_personal and super().covers_evaluated_models()

    def personal_update(self, client: Any, data: ClientData, context: RoundContext,
                        generator: RandomSource) -> ClientUpdate:
        """Without privacy, the parent's loop; with it, DP-SGD steps (charged), or plain SGD steps that
        never leave the client (``private_personal=False``)."""
        privacy = self.privacy
        if privacy is None:
            return super().personal_update(client, data, context, generator)
        if self.private_personal:  # the private local loop with the personal step size
            rule = self.clip_rule(context)
            outputs = [client.training_step(dataclasses.replace(self.private_batch(data, rule, generator),
                                                                lr=self.personal_lr))
                       for _ in range(self.local_steps)]
            return self.client_update(client, data, outputs)
        losses = []
        for _ in range(self.personal_steps):
            mask = poisson_mask(data.size, privacy.sample_rate, generator)
            if bool(mask.any()):
                x, y = select_rows(mask, data.x, data.y)
                losses.append(client.training_step(LocalBatch(x=x, y=y, lr=self.personal_lr)).loss)
        return ClientUpdate(client_id=data.client_id, params=client.get_flat_params(), num_examples=data.size,
                            diagnostics={"personal_train_loss": sum(losses) / len(losses)} if losses else {})
