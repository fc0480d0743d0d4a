"""The client: a LightningModule whose manual-optimization step is the (fair-clipped) DP-SGD step.

One :class:`ClientModule` instance is reused for every client of a round (the federation loads
``w_t`` into it, runs the algorithm's local update, and reads the local model back), so memory
does not grow with the number of clients and no Trainer is built per client.

Bring a new model by passing any ``nn.Module`` (no BatchNorm) as ``net``, or subclass and
override :meth:`per_sample_loss` for a different task.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector

from fedfdp.errors import ConfigError
from fedfdp.privacy.mechanism import current_trace, stamp_model
from fedfdp.privacy.per_sample import make_engine
from fedfdp.privacy.release import gaussian_sum_release
from fedfdp.privacy.validation import replace_batchnorm as replace_batchnorm_layers
from fedfdp.types import MODEL_RELEASE, LocalBatch, StepOutput


_QUANTILES = torch.tensor([0.05, 0.5, 0.95])


def trainable(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``module`` that training updates and clients exchange (``requires_grad``).

    A frozen parameter (``requires_grad=False``) keeps its initial value: it is neither trained,
    nor uploaded, aggregated, stepped by the server optimizer or broadcast. Every flat parameter
    vector of a run (``w_t``, the clients' uploads) is over these parameters, in module order.
    """
    return [p for p in module.parameters() if p.requires_grad]


def _check_net(net: nn.Module) -> None:
    """A net the loop can train: at least one trainable parameter, and no parameter with no elements
    (a layer of width 0, which no per-sample engine and no update can handle)."""
    if not isinstance(net, nn.Module):
        raise ConfigError(f"model.client.init_args.net must be a torch.nn.Module, got {type(net).__name__}")
    empty = [f"{name} {tuple(p.shape)}" for name, p in net.named_parameters() if p.numel() == 0]
    if empty:
        raise ConfigError(f"model.client.init_args.net has parameters with no elements ({', '.join(empty[:3])}): a "
                          f"layer of width 0; check its init_args (hidden, channels, width, ...)")
    if not trainable(net):
        raise ConfigError("model.client.init_args.net has no trainable parameter (every one has requires_grad=False): "
                          "there is nothing to train")


class ClientModule(LightningModule):
    """A federated client's model and its local step.

    Args:
        net: the model (any ``nn.Module`` whose layers do not mix samples).
        per_sample: per-sample gradient engine: ``ghost`` (norms without materialising
            per-sample gradients; Linear/Conv2d models), ``vmap`` (``torch.func``, any model) or
            ``auto`` (ghost when supported).
        replace_batchnorm: replace every BatchNorm of ``net`` by a GroupNorm over the same
            channels (as Opacus' ``ModuleValidator.fix``). BatchNorm mixes the samples of a batch,
            so a private run refuses it; this opts in to the replacement.
    """

    def __init__(self, net: nn.Module, *, per_sample: Literal["auto", "ghost", "vmap"] = "auto",
                 replace_batchnorm: bool = False) -> None:
        super().__init__()
        _check_net(net)
        self.automatic_optimization = False
        self.net = replace_batchnorm_layers(net) if replace_batchnorm else net
        self.engine = make_engine(self.net, per_sample, self.per_sample_loss)
        # The local optimizer is a plain torch optimizer, not one returned by configure_optimizers:
        # the trainer's optimizer is the server's, whose steps count rounds (global_step).
        self.local_optimizer = self.configure_local_optimizer()

    def forward(self, x: Tensor) -> Tensor:
        """Model output for a batch."""
        return self.net(x)

    def per_sample_loss(self, output: Tensor, target: Tensor) -> Tensor:
        """Per-sample loss ``F_i(w, ξ_j)``, shape (B,). Cross-entropy by default."""
        return F.cross_entropy(output, target, reduction="none")

    def configure_local_optimizer(self) -> torch.optim.Optimizer:
        """The local optimizer; its learning rate is set from each :class:`LocalBatch`."""
        return torch.optim.SGD(self.net.parameters(), lr=1.0)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters that the local step updates (and that are exchanged with the server)."""
        return trainable(self.net)

    def get_flat_params(self) -> Tensor:
        """The local model as one detached vector.

        Read right after a private step, with nothing changed since, it is a model state the
        mechanism released (:mod:`fedfdp.privacy.mechanism`): the only kind of ``params`` an
        upload declared private may carry.
        """
        params = self.trainable_parameters()
        flat = parameters_to_vector(params).detach().clone()
        trace = current_trace()
        if trace is not None:
            trace.note_model_read(params, flat)
        return flat

    def set_flat_params(self, flat: Tensor) -> None:
        """Load a flat parameter vector (e.g. the broadcast global model ``w_t``)."""
        # copy_ rather than torch's vector_to_parameters, which makes the parameters *views* of
        # ``flat`` so that local steps would write into the caller's vector
        offset = 0
        with torch.no_grad():
            for param in self.trainable_parameters():
                n = param.numel()
                param.copy_(flat[offset:offset + n].view_as(param))
                offset += n

    def training_step(self, batch: LocalBatch, batch_idx: int = 0) -> StepOutput:  # type: ignore[override]
        """One local step: private (clip, noise, normalise; Eq. 12-13) or plain SGD."""
        if batch.clip_rule is None:
            return self._plain_step(batch)
        return self._private_step(batch)

    def _set_lr(self, lr: float) -> None:
        for group in self.local_optimizer.param_groups:
            group["lr"] = lr

    def _apply_grad_transform(self, batch: LocalBatch) -> None:
        """Add the algorithm's data-independent gradient terms (after privatisation)."""
        if batch.grad_transform is None:
            return
        params = self.trainable_parameters()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        for param, grad in zip(params, batch.grad_transform(params, grads)):
            param.grad = grad

    def _plain_step(self, batch: LocalBatch) -> StepOutput:
        """``w ← w − η · s(ℓ_b) · ∇ℓ_b`` with ``ℓ_b`` the batch-mean loss (FedFair Eq. 9 when scaled)."""
        self.local_optimizer.zero_grad(set_to_none=True)
        loss = self.per_sample_loss(self.net(batch.x), batch.y).mean()
        scaled = loss if batch.loss_scale is None else loss * batch.loss_scale(loss.detach())
        if self._trainer is not None:
            self.manual_backward(scaled)  # precision plugins (AMP scaling) apply
        else:
            scaled.backward()
        self._apply_grad_transform(batch)
        self._set_lr(batch.lr)
        self.local_optimizer.step()
        return StepOutput(loss=float(loss.detach()), batch_size=int(batch.y.shape[0]))

    def _private_step(self, batch: LocalBatch) -> StepOutput:
        """DP-SGD with a per-sample clip rule (FedFDP Alg. 2 lines 6-12).

        ``G = Σ_j s_j g_j + N(0, (σC)² I)``, ``w ← w − η G / n`` where ``s_j`` comes from the clip
        rule (flat or fair), ``σC = noise_std`` and ``n = denominator`` (expected batch size by
        default). Noise is added even for an empty batch.

        The work is split in two reusable halves: the clipped sum ``Σ_j s_j g_j`` from the
        per-sample engine (:meth:`clipped_sum`, chunked when ``batch.physical_batch_size`` is set),
        and :meth:`apply_private_sum` (noise, normalisation, optimizer step). A stacked round
        (:mod:`fedfdp.stacked`) forms the clipped sums of several clients from one pass over their
        joint batch and calls :meth:`apply_private_sum` per client.
        """
        assert batch.clip_rule is not None and batch.generator is not None
        return self.apply_private_sum(batch, *self.clipped_sum(batch))

    def clipped_sum(self, batch: LocalBatch) -> tuple[list[Tensor], Tensor, Tensor, Tensor]:
        """``(Σ_j s_j g_j, ℓ, ‖g‖, s)`` of ``batch`` at the parameters currently loaded.

        ``s_j = clip_rule(ℓ_j, ‖g_j‖)`` for every record ``j``; the sum is one tensor per trainable
        parameter, and ``ℓ``, ``‖g‖``, ``s`` are the per-sample losses, gradient norms and factors
        (shape (B,)). With ``batch.physical_batch_size = P`` the engine runs on the consecutive
        chunks ``B_k`` of at most ``P`` records and ``Σ_j s_j g_j = Σ_k Σ_{j∈B_k} s_j g_j`` is
        accumulated chunk by chunk (memory of a ``P``-record pass; the same sum up to
        floating-point order). The clip rule is then called once per chunk: its factors do not
        depend on the chunking (every rule maps a record's ``(ℓ_j, ‖g_j‖)`` to ``s_j`` alone), but
        statistics a rule keeps of its last call (``FairClip.last_negative_fraction``,
        ``CountingFlatClip``'s count) cover the last chunk only.
        """
        assert batch.clip_rule is not None
        if batch.physical_batch_size is not None and batch.physical_batch_size < 1:
            raise ValueError(f"physical_batch_size must be >= 1 or None, got {batch.physical_batch_size}")
        size = int(batch.y.shape[0])
        chunk = max(size, 1) if batch.physical_batch_size is None else batch.physical_batch_size
        total: list[Tensor] | None = None
        losses, norms, factors = [], [], []
        for start in range(0, max(size, 1), chunk):  # an empty batch: one pass, a zero sum
            result = self.engine.compute(batch.x[start:start + chunk], batch.y[start:start + chunk])
            part_factors = batch.clip_rule(result.losses, result.norms)
            part = result.weighted_sum(part_factors)  # before the next chunk's pass (engine buffers)
            total = part if total is None else [a + b for a, b in zip(total, part)]
            losses.append(result.losses)
            norms.append(result.norms)
            factors.append(part_factors)
        assert total is not None
        if len(losses) == 1:
            return total, losses[0], norms[0], factors[0]
        return total, torch.cat(losses), torch.cat(norms), torch.cat(factors)

    def apply_private_sum(self, batch: LocalBatch, clipped_sum: list[Tensor], losses: Tensor, norms: Tensor,
                          factors: Tensor) -> StepOutput:
        """The private step once ``clipped_sum = Σ_j s_j g_j`` of ``batch`` is known (Eq. 12-13).

        Adds ``N(0, (σC)² I)`` drawn from ``batch.generator``, sets ``grad = G / n``, applies the
        algorithm's ``grad_transform``, and steps the local optimizer at ``batch.lr`` from the
        parameters currently loaded. ``losses``, ``norms`` and ``factors`` are the batch's
        per-sample ``ℓ_j``, ``‖g_j‖`` and ``s_j`` (diagnostics only).

        This is the model release of the private mechanism: the noise is one recorded call of
        :func:`~fedfdp.privacy.release.gaussian_sum_release` (σ = ``noise_std / C``, q =
        ``batch.sample_rate``), and the parameters after the step are stamped as a released model
        state (:mod:`fedfdp.privacy.mechanism`).
        """
        assert batch.generator is not None and batch.clip_rule is not None
        noisy = gaussian_sum_release(clipped_sum, noise_std=batch.noise_std, sensitivity=batch.clip_rule.max_grad_norm,
                                     generator=batch.generator, kind=MODEL_RELEASE, sample_rate=batch.sample_rate,
                                     sample=batch)
        params = self.trainable_parameters()
        for param, grad in zip(params, noisy):
            param.grad = grad.div_(batch.denominator)  # ``grad`` is a fresh tensor
        self._apply_grad_transform(batch)
        self._set_lr(batch.lr)
        self.local_optimizer.step()
        stamp_model(params)
        n = int(batch.y.shape[0])
        clipped = float((norms * factors.abs() < norms - 1e-12).float().mean()) if n else 0.0
        negative = float(getattr(batch.clip_rule, "last_negative_fraction", 0.0))
        loss = float(losses.mean()) if n else 0.0
        quantiles = tuple(torch.quantile(factors.float(), _QUANTILES.to(factors.device)).tolist()) if n else (0.0,) * 3
        return StepOutput(loss=loss, batch_size=n, negative_fraction=negative, clipped_fraction=clipped,
                          factor_quantiles=quantiles)  # type: ignore[arg-type]
