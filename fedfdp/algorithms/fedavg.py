"""FedAvg (McMahan et al., AISTATS 2017): local SGD from ``w_t``, p_i-weighted averaging."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Literal

from torch import Tensor

from fedfdp.algorithms.base import Algorithm
from fedfdp.client import ClientModule
from fedfdp.errors import require
from fedfdp.seeding import RandomSource, poisson_mask, randperm, select_rows
from fedfdp.types import ClientData, ClientUpdate, LocalBatch, RoundContext

LocalMode = Literal["epoch", "poisson_batch"]


class FedAvg(Algorithm):
    """Non-private FedAvg.

    Args:
        lr: local learning rate η (the paper's non-private runs use 0.1).
        local_epochs: passes over the local data per round (``local_mode="epoch"``).
        batch_size: mini-batch size (``local_mode="epoch"``).
        local_mode: ``epoch`` — shuffled mini-batches over all of ``D_i`` (Alg. 1, default);
            ``poisson_batch`` — one Poisson batch of rate ``sample_rate`` per round (the
            authors' code, spec A-5).
        sample_rate: Poisson rate q for ``poisson_batch``.
    """

    supports_distributed = True  # see Algorithm.supports_distributed

    def __init__(self, *, lr: float = 0.1, local_epochs: int = 1, batch_size: int = 64,
                 local_mode: LocalMode = "epoch", sample_rate: float = 0.05) -> None:
        require(lr > 0, f"algorithm.lr must be > 0, got {lr}")
        require(local_epochs >= 1, f"algorithm.local_epochs must be >= 1, got {local_epochs}")
        require(batch_size >= 1, f"algorithm.batch_size must be >= 1, got {batch_size}")
        require(local_mode in ("epoch", "poisson_batch"),
                f"algorithm.local_mode must be one of ['epoch', 'poisson_batch'], got {local_mode!r}")
        require(0 < sample_rate <= 1, f"algorithm.sample_rate must be in (0, 1], got {sample_rate}")
        self.lr = lr
        self.local_epochs = local_epochs
        self.batch_size = batch_size
        self.local_mode = local_mode
        self.sample_rate = sample_rate

    def local_batches(self, data: ClientData, generator: RandomSource) -> Iterator[tuple[Tensor, Tensor]]:
        """The round's local mini-batches (seeded by ``generator``)."""
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
        """Local SGD from ``w_t`` over :meth:`local_batches`."""
        scale = self.loss_scale(context)
        losses = []
        for x, y in self.local_batches(data, generator):
            if y.numel() == 0:
                continue
            out = client.training_step(LocalBatch(x=x, y=y, lr=self.lr, loss_scale=scale))
            losses.append(out.loss)
        diagnostics = {"train_loss": sum(losses) / len(losses)} if losses else {}
        return ClientUpdate(client_id=data.client_id, params=client.get_flat_params(),
                            num_examples=data.size, diagnostics=diagnostics)
