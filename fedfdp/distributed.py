"""Multi-process and multi-node federations on Lightning's DDP machinery (torch.distributed).

Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` already does what a multi-process
federation needs from the platform: it launches the processes (``devices`` per node, ``num_nodes``
nodes, SLURM/torchrun environments detected), initialises the process group (gloo on CPU, NCCL on
GPU), seeds every rank alike and writes checkpoints from rank 0. What it must *not* do here is
wrap the federation in ``DistributedDataParallel``: DDP all-reduces parameter gradients on every
backward pass, while in a federation each rank trains *different* clients and only the uploads are
exchanged. :class:`FederatedDDPStrategy` is DDP without the wrapper; the exchange is
:func:`gather_updates`, called by :class:`fedfdp.Federation` once per round.

The round under ``world_size`` ranks (:meth:`fedfdp.Federation.training_step`):

1. every rank samples the same clients (seeded by round); client ``k`` of the sorted list is
   trained by rank ``k mod world_size`` with the client's own seeded generators, so each client's
   update is the one a single process would compute;
2. the updates are all-gathered and put back in client order; every rank then charges the same
   DP events to its accountant, aggregates the same updates and steps the same server optimizer,
   so the global model and ε are identical on every rank and equal to a single process's;
3. evaluation shards the pooled test data over the ranks; torchmetrics sums the per-client
   counts across ranks.

Usage (config or command line)::

    trainer:
      strategy: federated_ddp   # registered with Lightning's strategy registry
      accelerator: cpu          # or gpu
      devices: 2                # processes per node
      num_nodes: 1
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

__all__ = ["FederatedDDPStrategy", "gather_updates", "rank_and_world"]


class FederatedDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy (launch, process group, rank-0 checkpoints) without the DDP wrapper.

    Accepts every :class:`~lightning.pytorch.strategies.DDPStrategy` argument
    (``process_group_backend``, ``timeout``, ``start_method``, ...).
    """

    strategy_name = "federated_ddp"

    def configure_ddp(self) -> None:
        """Keep the federation unwrapped: clients' local gradients must never be all-reduced."""


StrategyRegistry.register(FederatedDDPStrategy.strategy_name, FederatedDDPStrategy,
                          description="DDP launch and process group for federations (no gradient all-reduce)",
                          override=True)


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process; ``(0, 1)`` without an initialised process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_updates(local: list[Any]) -> list[Any]:
    """All-gather every rank's list of client updates (one flat list, rank-major order)."""
    rank, world = rank_and_world()
    if world == 1:
        return list(local)
    # tensors travel on CPU: gloo and pickling both handle them; the caller moves them back
    cpu = [_to_cpu(update) for update in local]
    gathered: list[list[Any] | None] = [None] * world
    dist.all_gather_object(gathered, cpu)
    return [update for part in gathered for update in (part or [])]


def _to_cpu(update: Any) -> Any:
    params = getattr(update, "params", None)
    if isinstance(params, torch.Tensor) and params.device.type != "cpu":
        update.params = params.cpu()
    return update
