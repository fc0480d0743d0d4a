"""Data-independent gradient terms added after privatisation (FedProx, SCAFFOLD, FedDyn, Ditto).

The shipped local loops (:class:`FedAvg`'s, private or not) build one :class:`LocalBatch` per
step. :class:`GradTermMixin` runs that same loop with a client wrapper that attaches a
``grad_transform`` to every batch: ``g ← g + term(w)``, where ``g`` is the plain mini-batch
gradient (non-private) or the clipped, noised and normalised gradient (private), and ``term``
depends only on the current local parameters and on quantities the client already holds
(``w_t``, control variates, its gradient memory). Added after the noise it is post-processing
and costs no privacy; inside the per-sample loss it would be clipped away.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.nn.utils import parameters_to_vector

from fedfdp.seeding import RandomSource
from fedfdp.types import ClientData, ClientUpdate, LocalBatch, RoundContext, StepOutput

if TYPE_CHECKING:
    from fedfdp.client import ClientModule

GradTerm = Callable[[Tensor], Tensor]
"""``term(w_flat) -> flat tensor`` added to the (privatised) gradient at local parameters ``w``."""


def flat_grad_transform(term: GradTerm) -> Callable[[list[Tensor], list[Tensor]], list[Tensor]]:
    """A ``LocalBatch.grad_transform`` adding the flat vector ``term(w)`` to the per-tensor grads."""

    def transform(params: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
        extra = term(parameters_to_vector([p.detach() for p in params]))
        out, offset = [], 0
        for grad in grads:
            n = grad.numel()
            out.append(grad + extra[offset:offset + n].view_as(grad))
            offset += n
        return out

    return transform


class TermClient:
    """Wraps a :class:`ClientModule`: every local step gets ``term`` as its grad transform.

    Everything else (``get_flat_params``, ``per_sample_loss``, ...) is the wrapped client's.
    ``steps`` counts the local steps taken (SCAFFOLD's K).
    """

    def __init__(self, client: ClientModule, term: GradTerm | None) -> None:
        self._client = client
        self._transform = flat_grad_transform(term) if term is not None else None
        self.steps = 0

    def training_step(self, batch: LocalBatch, batch_idx: int = 0) -> StepOutput:
        """The wrapped client's step with the grad transform attached."""
        self.steps += 1
        if self._transform is not None:
            batch = dataclasses.replace(batch, grad_transform=self._transform)
        return self._client.training_step(batch, batch_idx)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class GradTermMixin:
    """Runs the parent algorithm's local loop with :meth:`grad_term` added to each step's gradient.

    Subclasses implement :meth:`grad_term` and may post-process the upload in
    :meth:`after_local_update` (e.g. update a control variate from the released model).
    """

    def grad_term(self, client_id: int, start: Tensor, context: RoundContext) -> GradTerm | None:
        """The term for this client and round (``start`` = the model it starts from)."""
        raise NotImplementedError

    def after_local_update(self, update: ClientUpdate, start: Tensor, steps: int, context: RoundContext) -> None:
        """Hook after the local loop; ``update.params`` is the (released) local model."""

    def local_update(self, client: ClientModule, data: ClientData, context: RoundContext,
                     generator: RandomSource) -> ClientUpdate:
        """The parent's local loop with the grad term attached to every step."""
        start = client.get_flat_params()
        wrapped = TermClient(client, self.grad_term(data.client_id, start, context))
        update = super().local_update(wrapped, data, context, generator)  # type: ignore[misc, arg-type]
        self.after_local_update(update, start, wrapped.steps, context)
        return update
