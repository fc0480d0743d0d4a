"""DP-FedAvg (DP-FedSGD with one local step): sample-level DP-SGD on every client.

Each local step samples a Poisson batch of rate q, clips every per-sample gradient to norm C,
adds ``N(0, (σC)² I)`` to the sum and divides by the expected batch size (spec §1.2 (a) with
λ = 0; Abadi et al. 2016). One Poisson-sampled Gaussian event (q, σ) per step is charged to the
client's ledger by :class:`callbacks.RDPAccounting`.
"""

from __future__ import annotations

from fedfdp.algorithms.base import Algorithm
from fedfdp.client import ClientModule
from fedfdp.errors import require
from fedfdp.privacy.accounting import DPEvent
from fedfdp.privacy.clipping import ClipRule, FlatClip
from fedfdp.privacy.release import NormalizeBy, batch_denominator
from fedfdp.privacy.validation import DPRelease
from fedfdp.privacy.sampling import poisson_sample
from fedfdp.seeding import RandomSource
from fedfdp.types import MODEL_RELEASE, ClientData, ClientUpdate, LocalBatch, RoundContext, StackedStepSpec, StepOutput


class DPFedAvg(Algorithm):
    """Federated averaging of DP-SGD local models.

    Args:
        lr: local learning rate η (paper: 1.0).
        sample_rate: Poisson sampling rate q per client (paper: 0.05).
        max_grad_norm: per-sample clip bound C (paper: 0.1).
        noise_multiplier: σ; the noise std on the clipped sum is σC (paper: 2.0).
        local_steps: DP-SGD steps per round (paper: 1); each is one accounted event.
        normalize_by: divisor of the noisy sum: ``expected`` q|D_i| (default), ``realized``
            |B_i| (paper), ``constant`` (authors' code) — spec §3.8.
        normalize_constant: the divisor for ``normalize_by="constant"`` (code: 64).
    """

    supports_distributed = True  # see Algorithm.supports_distributed

    required_callbacks = ("callbacks.RDPAccounting",)

    def __init__(self, *, lr: float = 1.0, sample_rate: float = 0.05, max_grad_norm: float = 0.1,
                 noise_multiplier: float = 2.0, local_steps: int = 1,
                 normalize_by: NormalizeBy = "expected", normalize_constant: float = 64.0) -> None:
        require(lr > 0, f"algorithm.lr must be > 0, got {lr}")
        require(0 < sample_rate <= 1, f"algorithm.sample_rate must be in (0, 1], got {sample_rate}")
        require(0 < max_grad_norm < float("inf"), f"algorithm.max_grad_norm must be finite and > 0, got {max_grad_norm}")
        require(noise_multiplier >= 0, f"algorithm.noise_multiplier must be >= 0, got {noise_multiplier}")
        require(local_steps >= 1, f"algorithm.local_steps must be >= 1, got {local_steps}")
        require(normalize_by in ("expected", "realized", "constant"),
                f"algorithm.normalize_by must be one of ['expected', 'realized', 'constant'], got {normalize_by!r}")
        require(normalize_constant > 0, f"algorithm.normalize_constant must be > 0, got {normalize_constant}")
        self.lr = lr
        self.sample_rate = sample_rate
        self.max_grad_norm = max_grad_norm
        self.noise_multiplier = noise_multiplier
        self.local_steps = local_steps
        self.normalize_by = normalize_by
        self.normalize_constant = normalize_constant

    def clip_rule(self, context: RoundContext) -> ClipRule:
        """Per-sample clip rule of this round: flat clipping at C."""
        return FlatClip(self.max_grad_norm)

    def planned_dp_events(self, client_id: int, dataset_size: int) -> list[tuple[str, DPEvent]]:
        """``local_steps`` Poisson-sampled Gaussian mechanisms SGM(q, σ) per round."""
        if self.noise_multiplier == 0:
            return []  # σ = 0 is not private; RDPAccounting refuses it when a budget is set
        return [(MODEL_RELEASE, DPEvent(noise_multiplier=self.noise_multiplier,
                                        sample_rate=self.sample_rate, steps=self.local_steps))]

    def dp_releases(self) -> list[DPRelease]:
        """The model update: per-sample clip ``C`` (``max_grad_norm``), noise ``σC``."""
        return [DPRelease(name="model update", noise_field="algorithm.noise_multiplier",
                          noise_multiplier=self.noise_multiplier, bound_field="algorithm.max_grad_norm",
                          clip_bound=self.max_grad_norm)]

    def upload_privacy(self) -> dict[str, str | None]:
        """The local model is the output of the DP-SGD steps (kind ``model``)."""
        return {"params": MODEL_RELEASE}

    def local_lr(self, context: RoundContext) -> float:
        """The local learning rate of this round's steps (``lr``; a schedule overrides this: it reads
        the round from ``context`` and leaves nothing on the algorithm, :mod:`fedfdp.privacy.channel`)."""
        return self.lr

    def local_update(self, client: ClientModule, data: ClientData, context: RoundContext,
                     generator: RandomSource) -> ClientUpdate:
        """``local_steps`` private steps, each on a fresh Poisson batch."""
        rule, lr = self.clip_rule(context), self.local_lr(context)
        outputs = [client.training_step(self.at_lr(self.private_batch(data, rule, generator), lr))
                   for _ in range(self.local_steps)]
        return self.client_update(client, data, outputs)

    @staticmethod
    def at_lr(batch: LocalBatch, lr: float) -> LocalBatch:
        """``batch`` stepped at ``lr`` (the round's :meth:`local_lr`)."""
        batch.lr = lr
        return batch

    def private_batch(self, data: ClientData, rule: ClipRule, generator: RandomSource) -> LocalBatch:
        """One private step's input: a Poisson batch of rate q drawn from ``generator`` (its next draw).

        The step's noise ``N(0, (σC)² I)`` is drawn later from the same ``generator``; the divisor
        is :func:`~fedfdp.privacy.release.batch_denominator` (``normalize_by``).
        """
        x, y = poisson_sample(data, self.sample_rate, generator)  # drawn by the mechanism
        denominator = batch_denominator(self.normalize_by, sample_rate=self.sample_rate,
                                        dataset_size=data.size, realized=int(y.shape[0]),
                                        constant=self.normalize_constant)
        return LocalBatch(x=x, y=y, lr=self.lr, clip_rule=rule, noise_multiplier=self.noise_multiplier,
                          denominator=denominator, generator=generator, sample_rate=self.sample_rate)

    def client_update(self, client: ClientModule, data: ClientData, outputs: list[StepOutput]) -> ClientUpdate:
        """The upload after the local steps: the local model in ``client``, ``|D_i|``, the DP events and
        the steps' mean diagnostics."""
        stats = dict.fromkeys(["batch_size", "negative_fraction", "clipped_fraction", "train_loss",
                               "factor_p05", "factor_p50", "factor_p95"], 0.0)
        for out in outputs:
            stats["batch_size"] += out.batch_size / self.local_steps
            stats["negative_fraction"] += out.negative_fraction / self.local_steps
            stats["clipped_fraction"] += out.clipped_fraction / self.local_steps
            stats["train_loss"] += out.loss / self.local_steps
            for key, value in zip(("factor_p05", "factor_p50", "factor_p95"), out.factor_quantiles):
                stats[key] += value / self.local_steps
        return ClientUpdate(client_id=data.client_id, params=client.get_flat_params(), num_examples=data.size,
                            dp_events=self.planned_dp_events(data.client_id, data.size), diagnostics=stats)

    def stackable_step(self, context: RoundContext) -> StackedStepSpec | None:
        """The private steps of a client from its start model: one step (:meth:`one_step_spec`), or
        ``local_steps`` lockstep steps (:meth:`lockstep_spec`); None when a subclass (or mixin)
        replaces :meth:`local_update` (its own local update must then run, unless it declares its own
        equivalent step from :meth:`one_step_spec`)."""
        if type(self).local_update is not DPFedAvg.local_update:
            return None
        if self.local_steps == 1:
            return self.one_step_spec(context)
        return self.lockstep_spec(context)

    def lockstep_spec(self, context: RoundContext) -> StackedStepSpec:
        """:meth:`local_update` with ``local_steps = K`` as K lockstep steps of a stacked round.

        As in :meth:`local_update`, each client gets one clip rule for its K steps (made at its first
        batch), K Poisson batches and K noise draws from its own generator, and the upload of
        :meth:`client_update` from its K step outputs.
        """
        rules: dict[int, ClipRule] = {}
        lr = self.local_lr(context)

        def batch(data: ClientData, generator: RandomSource) -> LocalBatch:
            if data.client_id not in rules:
                rules[data.client_id] = self.clip_rule(context)
            return self.at_lr(self.private_batch(data, rules[data.client_id], generator), lr)

        return StackedStepSpec(
            batch=batch, update=lambda client, data, output: self.client_update(client, data, [output]),
            sample_rate=self.sample_rate, steps=self.local_steps,
            update_steps=lambda client, data, outputs: self.client_update(client, data, outputs))

    def one_step_spec(self, context: RoundContext) -> StackedStepSpec | None:
        """:meth:`local_update` with ``local_steps = 1`` in the two halves of a stacked round (None for
        several steps): the client's private batch and fresh clip rule, and :meth:`client_update`."""
        if self.local_steps != 1:
            return None
        lr = self.local_lr(context)
        return StackedStepSpec(
            batch=lambda data, generator: self.at_lr(self.private_batch(data, self.clip_rule(context), generator), lr),
            update=lambda client, data, output: self.client_update(client, data, [output]),
            sample_rate=self.sample_rate)
