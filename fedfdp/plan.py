"""Refuse a run whose plan is absurd before its first round: one line that gives the number.

The options each pass their own checks, but together they can plan a run that would never end
or would not mean anything. Checked when the federation is set up (and again once a checkpoint
is restored), before any file of the run is written:

* :func:`check_round_count`: more than :data:`MAX_ROUNDS` rounds planned, by ``model.num_rounds``
  or by the privacy budget (a noise multiplier so large that the budget allows astronomically
  many rounds);
* :func:`check_expected_batches`: a Poisson-sampled private release whose expected batch
  ``q·|D_i|`` is below one record for some client (its steps would mostly be noise on empty
  batches);
* :func:`check_model_fits_data`: a model that does not take the data's inputs or does not give one
  score per class;
* :func:`check_required_callbacks`: an algorithm without the callbacks that privatise, account or
  provide what it releases;
* :func:`check_distributed`: several processes with a strategy that would all-reduce the clients'
  gradients, or with parts that keep per-client state on one process.

An ε the accountant cannot reach in one round is refused by ``callbacks.RDPAccounting`` with
the ε one round spends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fedfdp.errors import ConfigError
from fedfdp.interfaces import FederationHooks, is_instance_of
from fedfdp.privacy.planning import MAX_ROUNDS  # the planner's bound, named here for the checks

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from fedfdp.algorithms.base import Algorithm
    from fedfdp.client import ClientModule
    from fedfdp.interfaces import FederatedData, FederationView

__all__ = ["MAX_ROUNDS", "check_distributed", "check_expected_batches", "check_model_fits_data",
           "check_required_callbacks", "check_round_count"]


def check_round_count(total_rounds: int, num_rounds: int | None, budget_rounds: int | None) -> None:
    """Refuse ``total_rounds > MAX_ROUNDS``, naming what planned them.

    Args:
        total_rounds: the rounds planned (the smaller of ``num_rounds`` and the callbacks' limits).
        num_rounds: ``model.num_rounds`` (``None``: run to the budget).
        budget_rounds: the rounds the callbacks' limits (the privacy budget) allow, ``None`` if none
            (more than ``MAX_ROUNDS``: the accountant stops counting at ``MAX_ROUNDS + 1``).
    """
    if total_rounds <= MAX_ROUNDS:
        return
    if budget_rounds is not None and (num_rounds is None or budget_rounds <= num_rounds):
        raise ConfigError(f"the privacy budget allows more than {MAX_ROUNDS:,} rounds, the most a run may plan (is "
                          f"the noise multiplier or the target epsilon far too large?); set model.num_rounds to at "
                          f"most {MAX_ROUNDS:,}")
    raise ConfigError(f"model.num_rounds must be at most {MAX_ROUNDS:,}, got {num_rounds:,}")


def check_expected_batches(federation: FederationView) -> None:
    """Refuse a private release whose expected Poisson batch ``q·|D_i|`` is below one record for a client.

    Every Poisson-sampled event (``sample_rate < 1``) of every client's planned round is checked
    (:meth:`fedfdp.Federation.planned_dp_events`: the algorithm's and the callbacks' releases).
    """
    sizes = federation.datamodule.train_sizes
    checked: set[tuple[str, float, int]] = set()
    for cid in range(federation.num_clients):
        size = int(sizes[cid])
        for name, event in federation.planned_dp_events(cid):
            q = float(event.sample_rate)
            if q >= 1.0 or (name, q, size) in checked:
                continue
            checked.add((name, q, size))
            if q * size < 1.0:
                raise ConfigError(
                    f"the {name} release samples each record with probability q={q:.4g}: client {cid} "
                    f"({size} training records) then has an expected batch of q*|D_i|={q * size:.3g} records, "
                    f"below one; raise the algorithm's sample rate to at least {1.0 / max(size, 1):.4g} "
                    f"(or give the clients more data)")


@torch.no_grad()
def check_model_fits_data(net: torch.nn.Module, datamodule: FederatedData) -> None:
    """One forward pass on two training records: the net must take the data's inputs and give one
    score per class. Run before training starts, so a mismatch is one line and no file of the
    run is written. Evaluation mode (no BatchNorm statistics updated, no dropout draws): the
    check changes no state and consumes no random number."""
    client = next((c for c in range(datamodule.num_clients) if int(datamodule.train_sizes[c]) > 0), None)
    if client is None or not getattr(datamodule, "holds_samples", True):
        return  # no data here (a Flower server: the samples stay on the nodes)
    x, _ = datamodule.client_train(client)
    training = net.training
    net.eval()
    try:
        out = net(x[:2])
    except RuntimeError as err:
        raise ConfigError(f"model.client.init_args.net does not accept the data's inputs of shape "
                          f"{tuple(x.shape[1:])} ({str(err).splitlines()[0]}); check its in_channels/image_size/"
                          f"input size") from err
    finally:
        net.train(training)
    classes = datamodule.num_classes
    if out.ndim != 2 or out.shape[1] != classes:
        raise ConfigError(f"model.client.init_args.net gives outputs of shape {tuple(out.shape[1:])} per record, but "
                          f"the data has {classes} classes: set its num_classes to {classes}")


def check_required_callbacks(algorithm: Algorithm, callbacks: Sequence[FederationHooks]) -> None:
    """Refuse an algorithm whose ``required_callbacks`` (what privatises, accounts or provides what it
    releases) are not all among the trainer's federation callbacks."""
    for required in algorithm.required_callbacks:
        if not any(is_instance_of(cb, required) for cb in callbacks):
            raise ConfigError(
                f"{type(algorithm).__name__} needs a {required} in trainer.callbacks "
                f"(it privatises/accounts or provides what the algorithm releases)")


def check_distributed(trainer: Trainer, algorithm: Algorithm, client: ClientModule,
                      callbacks: Sequence[FederationHooks]) -> None:
    """Several processes need a strategy that does not all-reduce gradients, and parts that allow it."""
    from lightning.pytorch.strategies import ParallelStrategy

    from fedfdp.distributed import FederatedDDPStrategy

    world = trainer.world_size
    if world == 1:
        return
    if not isinstance(trainer.strategy, FederatedDDPStrategy):
        if isinstance(trainer.strategy, ParallelStrategy):
            raise ConfigError(f"trainer.strategy must be 'federated_ddp' for {world} processes, got "
                              f"{type(trainer.strategy).__name__} (it would all-reduce the clients' "
                              f"local gradients)")
        return
    if not algorithm.supports_distributed:
        raise ConfigError(f"{type(algorithm).__name__} keeps per-client state on the process that trains "
                          f"the client and cannot run on {world} processes; use trainer.devices: 1")
    if client.local_optimizer_state == "kept":
        raise ConfigError(f"model.client.init_args.local_optimizer_state: kept keeps each client's optimizer "
                          f"state on the process that trains it and cannot run on {world} processes; use "
                          f"trainer.devices: 1 or local_optimizer_state: fresh")
    for cb in callbacks:
        if not cb.supports_distributed:
            raise ConfigError(f"callbacks.{type(cb).__name__} cannot run on {world} processes; "
                              f"use trainer.devices: 1")
