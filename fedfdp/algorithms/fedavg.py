"""FedAvg (McMahan et al., AISTATS 2017): local SGD from ``w_t``, p_i-weighted averaging.

Without ``privacy`` the local update is plain SGD over the client's data (:meth:`FedAvg.local_update`).
With ``privacy=SampleLevelDP(...)`` it is DP-FedAvg (DP-FedSGD with ``local_steps`` private
steps): each step is one step of the mechanism (:class:`fedfdp.privacy.SampleLevelDP`: a Poisson
batch of rate q, per-sample clipping to C with :meth:`FedAvg.clip_rule`, ``N(0, (σC)² I)`` on the
sum, the sum over the expected batch size; spec §1.2 (a) with λ = 0; Abadi et al. 2016), charged
as one SGM(q, σ) event of the record unit by :class:`callbacks.RDPAccounting`.

With ``privacy=ClientLevelDP(...)`` it is client-level DP-FedAvg (McMahan et al. 2018): the clients
run the plain loop (or, with ``ClientLevelDP(local=SampleLevelDP(...))``, the private steps above,
charged to their own ledgers), and the mechanism (:class:`fedfdp.privacy.ClientLevelDP`) samples the cohort,
clips each update ``w_k − w_t`` to C and releases the noisy sum over the expected cohort in place of
:meth:`aggregate`; one SGM(q, z) of the client unit per round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Literal

from torch import Tensor

from fedfdp.algorithms.base import Algorithm
from fedfdp.client import ClientModule
from fedfdp.errors import ConfigError, require
from fedfdp.privacy.client_level import ClientLevelDP
from fedfdp.privacy.clipping import ClipRule
from fedfdp.privacy.sample_level import SampleLevelDP
from fedfdp.privacy.validation import DPRelease
from fedfdp.seeding import RandomSource, poisson_mask, randperm, select_rows
from fedfdp.types import (CLIENT_RELEASE, MODEL_RELEASE, ClientData, ClientUpdate, DPEvent, LocalBatch, RoundContext,
                          LocalStep, StepOutput)

LocalMode = Literal["epoch", "poisson_batch"]

#: The options of the non-private local loop, with their defaults (a private run's local steps are
#: the mechanism's: ``privacy.local_steps`` Poisson batches of rate ``privacy.sample_rate``).
PLAIN_LOOP_DEFAULTS = {"local_epochs": 1, "batch_size": 64, "local_mode": "epoch", "sample_rate": 0.05}


class FedAvg(Algorithm):
    """FedAvg, and with ``privacy`` DP-FedAvg.

    Args:
        lr: local learning rate η (the paper's non-private runs use 0.1, its DP runs 1.0).
        local_epochs: passes over the local data per round (``local_mode="epoch"``; non-private only).
        batch_size: mini-batch size (``local_mode="epoch"``; non-private only).
        local_mode: ``epoch`` — shuffled mini-batches over all of ``D_i`` (Alg. 1, default);
            ``poisson_batch`` — one Poisson batch of rate ``sample_rate`` per round (the
            authors' code, spec A-5). Non-private only.
        sample_rate: Poisson rate q for ``poisson_batch`` (non-private only; a private run's rate
            is ``privacy.sample_rate``).
        privacy: the privacy mechanism (:class:`fedfdp.privacy.SampleLevelDP`: DP-SGD in each
            client; :class:`fedfdp.privacy.ClientLevelDP`: each client hidden whole, the plain loop
            in the clients), or None: a non-private run.
    """

    supports_distributed = True  # see Algorithm.supports_distributed

    #: Whether the algorithm runs without a privacy mechanism (False: ``privacy`` is required).
    runs_without_privacy: bool = True

    #: Whether this class runs under :class:`~fedfdp.privacy.ClientLevelDP`: its clients' uploads are
    #: the model alone and its server half needs no upload beyond the mechanism's noisy mean. Read on
    #: the class itself only (fail-closed: a subclass that changes the local update or the server half
    #: declares it again, :meth:`takes_client_level`).
    accepts_client_level: ClassVar[bool] = True

    @classmethod
    def takes_client_level(cls) -> bool:
        """Whether ``cls`` itself declares :attr:`accepts_client_level` true (an inherited one does not count)."""
        return bool(vars(cls).get("accepts_client_level", False))

    def __init__(self, *, lr: float = 0.1, local_epochs: int = 1, batch_size: int = 64,
                 local_mode: LocalMode = "epoch", sample_rate: float = 0.05,
                 privacy: SampleLevelDP | ClientLevelDP | None = None) -> None:
        require(lr > 0, f"algorithm.lr must be > 0, got {lr}")
        require(local_epochs >= 1, f"algorithm.local_epochs must be >= 1, got {local_epochs}")
        require(batch_size >= 1, f"algorithm.batch_size must be >= 1, got {batch_size}")
        require(local_mode in ("epoch", "poisson_batch"),
                f"algorithm.local_mode must be one of ['epoch', 'poisson_batch'], got {local_mode!r}")
        require(0 < sample_rate <= 1, f"algorithm.sample_rate must be in (0, 1], got {sample_rate}")
        if privacy is None and not self.runs_without_privacy:
            raise ConfigError(f"{type(self).__name__} is private: algorithm.privacy must be a "
                              f"fedfdp.privacy.SampleLevelDP, got null")
        if isinstance(privacy, ClientLevelDP):
            require(self.takes_client_level(),
                    f"algorithm.privacy: {type(self).__name__} does not run under fedfdp.privacy.ClientLevelDP (its "
                    f"uploads or its server half hold more than the model update, or it does not declare "
                    f"accepts_client_level = True on its class); use fedfdp.algorithms.FedAvg or FedProx")
            server_half = [hook for hook in ("aggregate", "on_round_end")
                           if getattr(type(self), hook) is not getattr(FedAvg, hook)]
            if server_half:
                raise ConfigError(f"algorithm.privacy: {type(self).__name__} overrides {server_half[0]}, which "
                                  f"fedfdp.privacy.ClientLevelDP never calls with the uploads (the server half sees "
                                  f"only the mechanism's noisy mean): remove the override or the mechanism")
        elif privacy is not None:
            require(isinstance(privacy, SampleLevelDP),
                    f"algorithm.privacy of {type(self).__name__} must be fedfdp.privacy.SampleLevelDP"
                    f"{', ClientLevelDP' if self.takes_client_level() else ''} or null, got {type(privacy).__name__}")
        if _record_mechanism(privacy) is not None:
            given = {"local_epochs": local_epochs, "batch_size": batch_size, "local_mode": local_mode,
                     "sample_rate": sample_rate}
            changed = sorted(k for k, v in given.items() if v != PLAIN_LOOP_DEFAULTS[k])
            require(not changed, f"algorithm.{', algorithm.'.join(changed)} set the non-private local loop; with "
                                 f"algorithm.privacy the local steps are privacy.local_steps Poisson batches of rate "
                                 f"privacy.sample_rate: remove them")
        self.lr = lr
        self.local_epochs = local_epochs
        self.batch_size = batch_size
        self.local_mode = local_mode
        self.sample_rate = sample_rate
        self.privacy = privacy

    @property
    def required_callbacks(self) -> tuple[str, ...]:  # type: ignore[override]
        """The accounting callback when private (see :attr:`Algorithm.required_callbacks`)."""
        return ("callbacks.RDPAccounting",) if self.privacy is not None else ()

    # ---- the non-private local loop -------------------------------------------------------------
    def local_batches(self, data: ClientData, generator: RandomSource) -> Iterator[tuple[Tensor, Tensor]]:
        """The round's local mini-batches of the non-private loop (seeded by ``generator``)."""
        if self.local_mode == "poisson_batch":
            mask = poisson_mask(data.size, self.sample_rate, generator)
            yield select_rows(mask, data.x, data.y)
            return
        for _ in range(self.local_epochs):
            order = randperm(data.size, generator)
            for start in range(0, data.size, self.batch_size):
                idx = order[start:start + self.batch_size]
                yield data.x[idx], data.y[idx]

    def loss_scale(self, context: RoundContext) -> Callable[[Tensor], Tensor] | None:
        """Multiplier of the batch-mean loss (None: plain SGD). FedFair overrides it."""
        return None

    def local_update(self, client: ClientModule, data: ClientData, context: RoundContext,
                     generator: RandomSource) -> ClientUpdate:
        """Local SGD from ``w_t`` over :meth:`local_batches`; with ``SampleLevelDP``, the private steps of
        :meth:`local_step` (with ``ClientLevelDP`` the plain loop: the mechanism clips and noises at
        aggregation)."""
        if self.record_mechanism is not None:
            return super().local_update(client, data, context, generator)
        scale, lr = self.loss_scale(context), self.local_lr(context)
        losses = []
        for x, y in self.local_batches(data, generator):
            if y.numel() == 0:
                continue
            out = client.training_step(LocalBatch(x=x, y=y, lr=lr, loss_scale=scale))
            losses.append(out.loss)
        diagnostics = {"train_loss": sum(losses) / len(losses)} if losses else {}
        return ClientUpdate(client_id=data.client_id, params=client.get_flat_params(),
                            num_examples=data.size, diagnostics=diagnostics)

    # ---- the private local loop: steps of the mechanism ----------------------------------------
    @property
    def record_mechanism(self) -> SampleLevelDP | None:
        """The record-level mechanism of the clients' steps: ``privacy`` itself, or the ``local`` one
        inside a ``ClientLevelDP``; None when the clients train without one."""
        return _record_mechanism(self.privacy)

    @property
    def mechanism(self) -> SampleLevelDP:
        """The record-level mechanism of the private steps (refused in one line where a run has none)."""
        mechanism = self.record_mechanism
        if mechanism is None:
            raise ConfigError(f"{type(self).__name__} made a private step without algorithm.privacy: "
                              f"fedfdp.privacy.SampleLevelDP")
        return mechanism

    @property
    def local_steps(self) -> int:
        """The private steps of a round (``privacy.local_steps``); a non-private run has none (its loop is
        ``local_epochs`` of ``batch_size`` batches, or one Poisson batch)."""
        if self.record_mechanism is None:
            raise AttributeError(f"a {type(self).__name__} without record-level privacy has no local_steps (its local loop is "
                                 f"local_epochs of batch_size batches, or one Poisson batch)")
        return self.mechanism.local_steps

    def clip_rule(self, context: RoundContext) -> ClipRule:
        """Per-sample clip rule of this round: the mechanism's flat clipping at C."""
        return self.mechanism.flat_clip()

    def planned_dp_events(self, client_id: int, dataset_size: int) -> list[tuple[str, DPEvent]]:
        """The record-level mechanism's events of a client's round (none without it: the client-level
        mechanism charges the population once a round, :meth:`ClientLevelDP.round_events`)."""
        record = self.record_mechanism
        return record.planned_events() if record is not None else []

    def dp_releases(self) -> list[DPRelease]:
        """The mechanism's releases: the model update (per-sample clip ``C``, noise ``σC``), or the
        round's aggregate (per-client clip ``C``, noise ``zC``)."""
        return [] if self.privacy is None else self.privacy.releases()

    def upload_privacy(self) -> dict[str, str | None]:
        """The local model is the output of the record-level mechanism's steps (kind ``model``; with
        ``ClientLevelDP`` too), else released only through the client-level mechanism's noisy sum (kind
        ``client_update``), or not private."""
        if isinstance(self.privacy, ClientLevelDP) and self.record_mechanism is None:
            return {"params": CLIENT_RELEASE}
        return {"params": MODEL_RELEASE if self.privacy is not None else None}

    # ---- the server state of a client-level mechanism (adaptive clipping's C_t) ----------------
    def on_round_end(self, updates: list[ClientUpdate], context: RoundContext) -> dict[str, float]:
        """Log the client-level mechanism's clip bound for the next round when it adapts (released
        counts' post-processing)."""
        if isinstance(self.privacy, ClientLevelDP) and self.privacy.adaptive:
            return {"client_clip_norm": self.privacy.current_clip_norm}
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The privacy mechanism's state, when it has one (adaptive clipping's ``C_t``)."""
        state = self.privacy.state_dict() if isinstance(self.privacy, ClientLevelDP) else {}
        return {"privacy": state} if state else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        if "privacy" in state and isinstance(self.privacy, ClientLevelDP):
            self.privacy.load_state_dict(state["privacy"])

    def local_lr(self, context: RoundContext) -> float:
        """The local learning rate of this round's steps, private or not (``lr``; a schedule overrides
        this: it reads the round from ``context`` and leaves nothing on the algorithm,
        :mod:`fedfdp.privacy.channel`)."""
        return self.lr

    def private_batch(self, data: ClientData, rule: ClipRule, generator: RandomSource) -> LocalBatch:
        """One private step's input at ``lr``, drawn by the mechanism (:meth:`SampleLevelDP.private_batch`)."""
        return self.mechanism.private_batch(data, rule, generator, self.lr)

    @staticmethod
    def at_lr(batch: LocalBatch, lr: float) -> LocalBatch:
        """``batch`` stepped at ``lr`` (the round's :meth:`local_lr`)."""
        batch.lr = lr
        return batch

    def client_update(self, client: ClientModule, data: ClientData, outputs: list[StepOutput]) -> ClientUpdate:
        """The upload after the private steps: the local model in ``client``, ``|D_i|``, the DP events
        and the steps' diagnostics (logs only)."""
        return ClientUpdate(client_id=data.client_id, params=client.get_flat_params(), num_examples=data.size,
                            dp_events=self.planned_dp_events(data.client_id, data.size),
                            diagnostics=self.mechanism.step_statistics(outputs, self.local_steps))

    # ---- the private steps, written once ---------------------------------------------------------
    def local_step(self, context: RoundContext) -> LocalStep | None:
        """The private steps of a client from its start model: one step (:meth:`one_step_spec`), or
        ``local_steps`` steps (:meth:`lockstep_spec`); None without a record-level mechanism (the
        plain loop of :meth:`local_update`)."""
        if self.record_mechanism is None:
            return None
        if self.local_steps == 1:
            return self.one_step_spec(context)
        return self.lockstep_spec(context)

    def lockstep_spec(self, context: RoundContext) -> LocalStep:
        """``local_steps = K`` private steps: each client gets one clip rule for its K steps (made at
        its first batch), K Poisson batches and K noise draws from its own generator (each step at
        the round's :meth:`local_lr`), and the upload of :meth:`client_update` from its K outputs.
        """
        rules: dict[int, ClipRule] = {}
        lr = self.local_lr(context)

        def batch(data: ClientData, generator: RandomSource) -> LocalBatch:
            if data.client_id not in rules:
                rules[data.client_id] = self.clip_rule(context)
            return self.at_lr(self.private_batch(data, rules[data.client_id], generator), lr)

        return LocalStep(
            batch=batch, update=lambda client, data, output: self.client_update(client, data, [output]),
            sample_rate=self.mechanism.sample_rate, steps=self.local_steps,
            update_steps=lambda client, data, outputs: self.client_update(client, data, outputs))

    def one_step_spec(self, context: RoundContext) -> LocalStep | None:
        """``local_steps = 1``: the client's private batch and fresh clip rule, and :meth:`client_update`
        (None for several steps, or without privacy)."""
        if self.record_mechanism is None or self.local_steps != 1:
            return None
        lr = self.local_lr(context)
        return LocalStep(
            batch=lambda data, generator: self.at_lr(self.private_batch(data, self.clip_rule(context), generator), lr),
            update=lambda client, data, output: self.client_update(client, data, [output]),
            sample_rate=self.mechanism.sample_rate)


def _record_mechanism(privacy: SampleLevelDP | ClientLevelDP | None) -> SampleLevelDP | None:
    """The record-level mechanism of a run's clients: ``privacy``, or a ``ClientLevelDP``'s ``local`` one."""
    if isinstance(privacy, ClientLevelDP):
        return privacy.local
    return privacy if isinstance(privacy, SampleLevelDP) else None
