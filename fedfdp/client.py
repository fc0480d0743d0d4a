"""The client: a LightningModule whose manual-optimization step is the (fair-clipped) DP-SGD step.

One :class:`ClientModule` instance is reused for every client of a round (the federation loads
``w_t`` into it, runs the algorithm's local update, and reads the local model back), so memory
does not grow with the number of clients and no Trainer is built per client.

Bring a new model by passing any ``nn.Module`` (no BatchNorm) as ``net``, or subclass and
override :meth:`per_sample_loss` for a different task.

The local update rule is a config choice (``local_optimizer``: any ``torch.optim`` optimizer,
SGD by default) whose learning rate is always the algorithm's (each :class:`LocalBatch`'s
``lr``). A private step hands it the clipped, noised gradient and nothing else, as Opacus'
``DPOptimizer`` wraps any optimizer: the update is post-processing of the noisy gradient and of
the optimizer's own state, itself computed from earlier noisy gradients. The optimizer is built
anew for each client's local update (``local_optimizer_state: fresh``, as FinP's code builds Adam
every round) or continues from the state that client left at its previous update
(``kept``): per-client state (e.g. Adam's moments) that stays on the client, is never uploaded,
and is saved in checkpoints (and on a Flower node) like SCAFFOLD's ``c_i``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector

from fedfdp.client_state import ClientStateStore
from fedfdp.errors import ConfigError, require
from fedfdp.privacy.mechanism import current_trace, stamp_model
from fedfdp.grad_sample.engine import make_engine
from fedfdp.privacy.release import gaussian_sum_release
from fedfdp.privacy.sampling import drawn_rate
from fedfdp.privacy.validation import replace_batchnorm as replace_batchnorm_layers
from fedfdp.types import MODEL_RELEASE, LocalBatch, StepOutput


_QUANTILES = torch.tensor([0.05, 0.5, 0.95])

LocalOptimizerState = Literal["fresh", "kept"]
"""``fresh``: a new local optimizer for every local update of every client; ``kept``: each client's
optimizer state carried from its previous local update (per-client client state)."""

_OPTIMIZER_FIELD = "model.client.init_args.local_optimizer"


def local_sgd(params: Any) -> torch.optim.Optimizer:
    """The default local optimizer: plain SGD, ``w ← w − η g`` with ``η`` each batch's ``lr``."""
    return torch.optim.SGD(params, lr=1.0)


def _phase_prefix(phase: str) -> str:
    if not phase or "/" in phase or "#" in phase:
        raise ValueError(f"local optimizer phase {phase!r} must be a non-empty name without '/' or '#'")
    return phase + "/"


def _check_local_optimizer(optimizer: Any) -> None:
    """A local optimizer the loop can drive: a torch optimizer whose ``step()`` needs nothing but the
    gradients (no closure re-evaluating the loss on data), with no learning rate of its own (the
    step size is the algorithm's ``lr``, set from each :class:`LocalBatch`)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"{_OPTIMIZER_FIELD} must build a torch.optim.Optimizer, got {type(optimizer).__name__}")
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ConfigError(f"{_OPTIMIZER_FIELD}: {name} re-evaluates the loss on the data in its step (a closure), "
                          f"which a private step cannot allow; use a first-order optimizer (SGD, Adam, AdamW, ...)")
    lr = inspect.signature(type(optimizer).__init__).parameters.get("lr")
    configured = optimizer.defaults.get("lr")
    if lr is not None and lr.default is not inspect.Parameter.empty and configured is not None:
        default = lr.default
        if isinstance(configured, Tensor) or isinstance(default, Tensor) or float(configured) != float(default):
            raise ConfigError(f"{_OPTIMIZER_FIELD} sets lr={configured}: the local step size is the algorithm's "
                              f"(model.algorithm.init_args.lr, set on every step); drop lr from its init_args")


def _flatten_state(state: dict[Any, dict[str, Any]], phase: str) -> dict[str, Tensor]:
    """An optimizer's per-parameter ``state`` as ``{"<phase>/<param index>/<key>": tensor}`` (copies;
    a Python number ``v`` as ``"…/<key>#<type>"``: a 0-d tensor)."""
    flat: dict[str, Tensor] = {}
    for index, entry in state.items():
        for key, value in entry.items():
            name = f"{phase}/{index}/{key}"
            if isinstance(value, Tensor):
                flat[name] = value.detach().clone()
            elif isinstance(value, (bool, int, float)):
                flat[f"{name}#{type(value).__name__}"] = torch.tensor(value)
            elif value is not None:
                raise ConfigError(f"{_OPTIMIZER_FIELD}: local_optimizer_state: kept cannot keep the "
                                  f"{type(value).__name__} {key!r} of the optimizer's state; use fresh")
    return flat


def _unflatten_state(flat: dict[str, Tensor], phase: str) -> dict[int, dict[str, Any]]:
    """Inverse of :func:`_flatten_state` for one phase's entries (copies)."""
    casts = {"bool": bool, "int": int, "float": float}
    state: dict[int, dict[str, Any]] = {}
    for name, value in flat.items():
        entry_phase, _, rest = name.partition("/")
        if entry_phase != phase:
            continue
        index, _, key = rest.partition("/")
        key, _, kind = key.partition("#")
        state.setdefault(int(index), {})[key] = casts[kind](value.item()) if kind else value.clone()
    return state


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
        local_optimizer: the local update rule, a callable ``params -> torch.optim.Optimizer``
            (config: ``{class_path: torch.optim.Adam, init_args: {betas: [0.9, 0.999]}}``); null
            (default): plain SGD. Its learning rate is the algorithm's ``lr`` (every
            :class:`LocalBatch`'s), so its init_args must not set ``lr``. A private step gives it
            the clipped, noised gradient (DP-SGD's noise and accounting are unchanged; only the
            update rule differs), then stamps the result as the released model.
        local_optimizer_state: ``fresh`` (or null, the default): the optimizer is built anew for every local
            update of every client (as FinP's code builds Adam every round); ``kept``: each
            client continues from the optimizer state it left (e.g. Adam's moments and step
            count), kept per client, never uploaded, saved in checkpoints. State is kept per
            phase of a local update (Ditto's personal steps have their own).
    """

    def __init__(self, net: nn.Module, *, per_sample: Literal["auto", "ghost", "vmap"] = "auto",
                 replace_batchnorm: bool = False, local_optimizer: OptimizerCallable | None = None,
                 local_optimizer_state: LocalOptimizerState | None = None) -> None:
        super().__init__()
        _check_net(net)
        require(local_optimizer_state in (None, "fresh", "kept"), f"model.client.init_args.local_optimizer_state "
                f"must be fresh, kept or null (fresh), got {local_optimizer_state!r}")
        require(local_optimizer is None or callable(local_optimizer), f"{_OPTIMIZER_FIELD} must be an optimizer "
                f"class_path (e.g. torch.optim.Adam), a callable params -> optimizer, or null (SGD), got "
                f"{type(local_optimizer).__name__}")
        self.automatic_optimization = False
        self.net = replace_batchnorm_layers(net) if replace_batchnorm else net
        self.engine = make_engine(self.net, per_sample, self.per_sample_loss)
        self._local_optimizer_factory = local_sgd if local_optimizer is None else local_optimizer
        # the default of a module that does not override configure_local_optimizer: plain SGD, no state
        self._plain_sgd = local_optimizer is None and type(self).configure_local_optimizer is \
            ClientModule.configure_local_optimizer
        self.local_optimizer_state: LocalOptimizerState = local_optimizer_state or "fresh"
        #: ``kept``: each client's optimizer state between its local updates, ``client id →
        #: "<phase>/<param index>/<key>" → tensor`` (client state: never uploaded; checkpointed).
        self.local_optimizer_states = ClientStateStore()
        # The local optimizer is a plain torch optimizer, not one returned by configure_optimizers:
        # the trainer's optimizer is the server's, whose steps count rounds (global_step).
        try:
            self.local_optimizer = self.configure_local_optimizer()
        except (TypeError, ValueError) as err:  # the optimizer's own check of its init_args
            raise ConfigError(f"{_OPTIMIZER_FIELD} could not be built: {err}") from err
        if local_optimizer is not None:
            _check_local_optimizer(self.local_optimizer)

    def forward(self, x: Tensor) -> Tensor:
        """Model output for a batch."""
        return self.net(x)

    def per_sample_loss(self, output: Tensor, target: Tensor) -> Tensor:
        """Per-sample loss ``F_i(w, ξ_j)``, shape (B,). Cross-entropy by default."""
        return F.cross_entropy(output, target, reduction="none")

    def configure_local_optimizer(self) -> torch.optim.Optimizer:
        """A new local optimizer (``local_optimizer`` on the net's parameters); its learning rate is
        set from each :class:`LocalBatch`."""
        return self._local_optimizer_factory(self.net.parameters())

    @contextmanager
    def local_optimizer_for(self, client_id: int, phase: str = "local") -> Iterator[torch.optim.Optimizer]:
        """Within the block, :attr:`local_optimizer` is client ``client_id``'s for ``phase`` of its local update.

        A new optimizer is built; with ``local_optimizer_state: kept`` it is loaded with the state
        the client left in this phase at its previous local update, and its state is stored back
        when the block ends. One module serves every client in turn: the federation opens this
        around each client's local update (:meth:`fedfdp.Federation.train_client`, each client of
        a stacked round), and an algorithm that trains a second model in the same update opens a
        nested block with its own ``phase`` (Ditto's personal model), so the two never share
        moments. The optimizer in use before the block is restored after it.
        """
        prefix = _phase_prefix(phase)
        if self._plain_sgd:  # stateless: the one optimizer serves every client (lr set at each step)
            yield self.local_optimizer
            return
        outer = self.local_optimizer
        optimizer = self.configure_local_optimizer()
        kept = self.local_optimizer_state == "kept"
        if kept:
            saved = _unflatten_state(self.local_optimizer_states.entry(client_id), phase)
            if saved:
                template = optimizer.state_dict()
                optimizer.load_state_dict({"state": saved, "param_groups": template["param_groups"]})
        self.local_optimizer = optimizer
        try:
            yield optimizer
            if kept:
                others = {k: v for k, v in self.local_optimizer_states.entry(client_id).items()
                          if not k.startswith(prefix)}
                own = _flatten_state(optimizer.state_dict()["state"], phase)
                self.local_optimizer_states.set_entry(client_id, {**others, **own})
        finally:
            self.local_optimizer = outer

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
        """Load a flat parameter vector (e.g. a cluster model, a personal model).

        Inside a client's update the mechanism notes what was loaded: a private step from anything
        but the start model, a public server state or a released state releases no model an
        upload may carry (:class:`fedfdp.privacy.mechanism.MechanismTrace`).
        """
        # copy_ rather than torch's vector_to_parameters, which makes the parameters *views* of
        # ``flat`` so that local steps would write into the caller's vector
        offset = 0
        params = self.trainable_parameters()
        with torch.no_grad():
            for param in params:
                n = param.numel()
                param.copy_(flat[offset:offset + n].view_as(param))
                offset += n
        trace = current_trace()
        if trace is not None:
            trace.note_load(params, flat)

    def load_start_model(self, flat: Tensor) -> None:
        """Load the model a client's update starts from (the federation's call: the broadcast ``w_t``
        or the start model the server half chose for the client)."""
        self.set_flat_params(flat)
        trace = current_trace()
        if trace is not None:
            trace.note_start(self.trainable_parameters(), flat)

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
        rule (flat or fair), ``σ = noise_multiplier`` and ``n = denominator`` (expected batch size by
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
        :func:`~fedfdp.privacy.release.gaussian_sum_release` (σ = ``noise_multiplier``, q =
        ``batch.sample_rate``), and the parameters after the step are stamped as a released model
        state (:mod:`fedfdp.privacy.mechanism`).
        """
        assert batch.generator is not None and batch.clip_rule is not None
        if batch.canary_sum is not None:  # an audit's canaries that joined this step (before the noise)
            offset, joined = 0, []
            for part in clipped_sum:
                joined.append(part + batch.canary_sum[offset:offset + part.numel()].view_as(part).to(part))
                offset += part.numel()
            clipped_sum = joined
        # the rate the mechanism drew this batch at, not the one declared with it (None: it did not draw it)
        noisy = gaussian_sum_release(clipped_sum, noise_multiplier=batch.noise_multiplier,
                                     sensitivity=batch.clip_rule.max_grad_norm,
                                     generator=batch.generator, kind=MODEL_RELEASE,
                                     sample_rate=drawn_rate(batch.x, batch.y), sample=batch)
        params = self.trainable_parameters()
        trace = current_trace()
        clean = trace is None or trace.is_clean(params)  # the step starts from a state the chain knows
        for param, grad in zip(params, noisy):
            param.grad = grad.div_(batch.denominator)  # ``grad`` is a fresh tensor
        self._apply_grad_transform(batch)
        self._set_lr(batch.lr)
        self.local_optimizer.step()
        stamp_model(params, clean)
        n = int(batch.y.shape[0])
        clipped = float((norms * factors.abs() < norms - 1e-12).float().mean()) if n else 0.0
        negative = float(getattr(batch.clip_rule, "last_negative_fraction", 0.0))
        loss = float(losses.mean()) if n else 0.0
        quantiles = tuple(torch.quantile(factors.float(), _QUANTILES.to(factors.device)).tolist()) if n else (0.0,) * 3
        return StepOutput(loss=loss, batch_size=n, negative_fraction=negative, clipped_fraction=clipped,
                          factor_quantiles=quantiles)  # type: ignore[arg-type]
