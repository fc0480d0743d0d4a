"""The federation: a LightningModule whose training step is one communication round.

``Trainer.fit`` drives the whole run. The server's model ``w_t`` is this module's
``global_model``; the aggregated client update is a pseudo-gradient ``w_t − aggregate`` for the
server optimizer returned by :meth:`Federation.configure_optimizers` (SGD with lr 1 is exactly
FedAvg's ``w_{t+1} = Σ p_i w_{t+1}^i``; FedAdam/FedYogi are a config change). With manual
optimization Lightning counts ``global_step`` only when that optimizer steps, so
``global_step`` is the round counter, ``max_steps`` the number of rounds, and
``trainer.fit(ckpt_path=...)`` resumes at the right round. Progress bar, loggers, checkpoints
and callbacks are Lightning's own.

The loop knows no algorithm and no DP formula: it calls the algorithm's hooks and the
federation callbacks' hooks in a fixed phase order (:class:`fedfdp.interfaces.FederationHooks`).
Its clients' half (local updates and their releases) is :mod:`fedfdp.client_work`, its evaluation
:mod:`fedfdp.evaluation`, the checks before the first round :mod:`fedfdp.plan`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable
from torch.nn.utils import parameters_to_vector
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, IterableDataset

from fedfdp.algorithms.base import Algorithm
from fedfdp.client import ClientModule, trainable
from fedfdp.client_work import FederationClientWork
from fedfdp.evaluation import TRAIN_EVAL_EVERY, FederationEvaluation
from fedfdp.interfaces import FederatedData, FederationHooks, is_federated_data
from fedfdp.errors import ConfigError, DivergenceError, PrivacyBudgetError, require
from fedfdp.memory import TRIM_EVERY, release_freed_memory
from fedfdp.metrics import EvaluationResult, eval_batch_size
from fedfdp.plan import (check_distributed, check_expected_batches, check_model_fits_data, check_required_callbacks,
                         check_round_count)
from fedfdp.privacy.accountant import PrivacyAccountant, run_accountant_of
from fedfdp.privacy.accounting import DPEvent
from fedfdp.privacy.channel import server_half
from fedfdp.privacy.sample_level import PrivacyMechanism
from fedfdp.seeding import numpy_generator
from fedfdp.stacked import StackedRound
from fedfdp.types import ClientUpdate

logger = logging.getLogger(__name__)

_NOT_SET = object()  # the accountant before setup has collected it


def _server_sgd(params: Any) -> torch.optim.Optimizer:
    """FedAvg's server step: SGD with learning rate 1 on the pseudo-gradient."""
    return torch.optim.SGD(params, lr=1.0)


class _Rounds(IterableDataset):
    """The training "data" of the federation: one item per round (its index).

    Iterable, so that under a distributed strategy Lightning does not shard the *rounds* across
    processes with a ``DistributedSampler``: every process takes part in every round.
    """

    def __init__(self, num_rounds: int) -> None:
        self.num_rounds = num_rounds

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(self.num_rounds))


class Federation(FederationClientWork, FederationEvaluation, LightningModule):
    """Federated training of ``client``'s model with ``algorithm``.

    Args:
        client: the client module (its ``net`` is the model architecture; its initial weights
            are ``w_0``).
        algorithm: the federated algorithm (``class_path`` in configs).
        num_rounds: number of rounds; ``null`` runs until a callback's limit (the privacy budget).
        clients_per_round: clients sampled uniformly per round (``null``: all, as in the paper).
        eval_every: evaluate the global model every this many rounds (and always at the end).
        eval_train_splits: also evaluate on every client's training split (Ψ_train_global).
        eval_train_every: evaluate the training splits (3x the test data in the paper's splits)
            every this many rounds, and at every evaluation of the last ``5 * eval_every`` rounds
            (so the final evaluation and the mean over the last five, as the FinP tables use, always
            have them); null: ``5 * eval_every``. Must be a multiple of ``eval_every``.
        eval_batch_size: batch size of evaluation passes (null: 128 on CPU, where a CNN's
            activations then stay in the cache, 4096 on accelerators; :func:`fedfdp.metrics.eval_batch_size`).
        server_optimizer: optimizer of the global model on the pseudo-gradient (SGD lr 1 = FedAvg).
        seed: seed of every random stream of the run (client sampling, Poisson batches, noise).
        secure_rng: draw Poisson masks and DP noise from the OS CSPRNG instead of seeded
            generators (for deployments; runs are then not reproducible). Off by default for speed
            and reproducibility.
        stacked_round: run a round's one-step private updates as one pass over the union of the
            clients' batches (:mod:`fedfdp.stacked`) whenever the algorithm declares a stackable
            step; same random streams and results (up to float rounding) as client by client.
            Off: always client by client.
        stacked_max_batch: samples per engine pass of a stacked round (groups of whole clients);
            null: 512 on CPU (larger batches leave the cache and cost more per sample), in effect
            the whole union on accelerators.
        ema_decay: keep an exponential moving average of the global weights,
            ``w̄_t = β w̄_{t-1} + (1 − β) w_t`` (``w̄_1 = w_1``), and evaluate, report and
            checkpoint it as the run's model (De et al. 2022). Training continues from ``w_t``.
            The average is post-processing of the released global models: no extra ε.
            null: no average.
    """

    def __init__(self, client: ClientModule, algorithm: Algorithm, *, num_rounds: int | None = 100,
                 clients_per_round: int | None = None, eval_every: int = 10, eval_train_splits: bool = True,
                 eval_train_every: int | None = None,
                 eval_batch_size: int | None = None, server_optimizer: OptimizerCallable = _server_sgd,
                 seed: int = 0, secure_rng: bool = False, stacked_round: bool = True,
                 stacked_max_batch: int | None = None, ema_decay: float | None = None) -> None:
        super().__init__()
        require(num_rounds is None or num_rounds >= 1, f"model.num_rounds must be >= 1 or null, got {num_rounds}")
        require(clients_per_round is None or clients_per_round >= 1,
                f"model.clients_per_round must be >= 1 or null, got {clients_per_round}")
        require(eval_every >= 1, f"model.eval_every must be >= 1, got {eval_every}")
        require(eval_train_every is None or (eval_train_every >= 1 and eval_train_every % eval_every == 0),
                f"model.eval_train_every must be a positive multiple of model.eval_every={eval_every} or null, "
                f"got {eval_train_every}")
        require(eval_batch_size is None or eval_batch_size >= 1,
                f"model.eval_batch_size must be >= 1 or null, got {eval_batch_size}")
        require(stacked_max_batch is None or stacked_max_batch >= 1,
                f"model.stacked_max_batch must be >= 1 or null, got {stacked_max_batch}")
        require(ema_decay is None or 0.0 <= ema_decay < 1.0, f"model.ema_decay must be in [0, 1) or null, got {ema_decay}")
        if not isinstance(algorithm, Algorithm):
            raise ConfigError(f"model.algorithm must be an fedfdp.algorithms.Algorithm, got {type(algorithm).__name__}")
        self.automatic_optimization = False
        self.client = client
        self.global_model = copy.deepcopy(client.net)
        self.ema_decay = ema_decay
        # torch's AveragedModel: a module, so the average and its update count are in the checkpoint
        self.global_ema = (AveragedModel(self.global_model, multi_avg_fn=get_ema_multi_avg_fn(ema_decay),
                                         use_buffers=True) if ema_decay is not None else None)
        self.algorithm = algorithm
        self.num_rounds = num_rounds
        self.clients_per_round = clients_per_round
        self.eval_every = eval_every
        self.eval_train_splits = eval_train_splits
        self.eval_train_every = eval_train_every if eval_train_every is not None else TRAIN_EVAL_EVERY * eval_every
        self._eval_batch_size = eval_batch_size
        self.server_optimizer = server_optimizer
        self.seed = seed
        self.secure_rng = secure_rng
        self.stacked_round = stacked_round
        self.stacked_max_batch = stacked_max_batch
        self._stacked = StackedRound(stacked_max_batch)
        self.total_rounds = num_rounds or 0
        self.start_round = 0  # rounds already done when fitting starts (the checkpoint's round)
        self.current_round = 0
        self.last_evaluation: EvaluationResult | None = None
        self._round_seconds: list[float] = []
        self.budget_limited = False  # the privacy budget (a callback's limit), not num_rounds, sets the rounds
        self.stop_signal: int | None = None  # the signal that stopped the run early (callbacks.GracefulInterrupt)
        self._declared_uploads: dict[str, str | None] | None = None  # upload field -> how it is private

    # ---- Lightning hooks ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The run's model's output (:attr:`released_model`)."""
        return self.released_model(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """The server optimizer over ``w_t`` (the trainable parameters: frozen ones are not stepped)."""
        return self.server_optimizer(trainable(self.global_model))

    def setup(self, stage: str) -> None:
        """Bind the data, check required callbacks, let the algorithm validate, fix the round count."""
        datamodule = self.trainer.datamodule
        if not is_federated_data(datamodule):  # a datamodules.FederatedDataModule, or anything with its members
            raise ConfigError(f"data must be a datamodules.FederatedDataModule, got {type(datamodule).__name__}")
        self.datamodule: FederatedData = datamodule
        require(self.clients_per_round is None or self.clients_per_round <= datamodule.num_clients,
                f"model.clients_per_round must be <= data.num_clients={datamodule.num_clients}, "
                f"got {self.clients_per_round}")
        mechanism = self.privacy_mechanism
        if mechanism is not None and mechanism.releases_aggregate:
            require(self.clients_per_round is None,
                    f"model.clients_per_round must be null with {type(mechanism).__name__}: its guarantee rests on "
                    f"how the cohort is drawn, so the mechanism draws it (algorithm.privacy.clients_per_round)")
            mechanism.sample_rate(datamodule.num_clients)  # refuses an expected cohort larger than N
        check_model_fits_data(self.client.net, datamodule)
        callbacks = self.federation_callbacks()
        self._accountant = run_accountant_of(callbacks)  # handed over by its callback; a second one is refused
        check_required_callbacks(self.algorithm, callbacks)
        check_distributed(self.trainer, self.algorithm, self.client, callbacks)
        self.algorithm.setup(self)
        for cb in callbacks:
            cb.setup_federation(self.trainer, self)
        check_expected_batches(self)
        self.start_round = 0
        self._plan_rounds()  # planned again in on_fit_start, once a checkpoint is restored
        logger.info("federation: %d clients, %d rounds, algorithm %s", self.num_clients, self.total_rounds,
                    type(self.algorithm).__name__)

    def _plan_rounds(self) -> None:
        """``total_rounds``: the smallest of ``num_rounds`` and every callback's limit (the budget);
        more than :data:`fedfdp.plan.MAX_ROUNDS` is refused."""
        budget = [lim for cb in self.federation_callbacks() if (lim := cb.max_rounds(self.trainer, self)) is not None]
        limits = budget + ([self.num_rounds] if self.num_rounds is not None else [])
        if not limits:
            raise ConfigError("model.num_rounds must be set (>= 1) when no callback limits the rounds "
                              "(e.g. callbacks.RDPAccounting with a target_epsilon)")
        check_round_count(min(limits), self.num_rounds, min(budget) if budget else None)
        self.total_rounds = min(limits)
        self.budget_limited = self.num_rounds is None or self.total_rounds < self.num_rounds
        if self.num_rounds is not None and self.total_rounds < self.num_rounds:
            logger.info("privacy budget allows %d of the %d requested rounds", self.total_rounds, self.num_rounds)
        self.trainer.fit_loop.epoch_loop.max_steps = self.total_rounds

    def train_dataloader(self) -> DataLoader:
        """One item per round; the round index itself is ``global_step``."""
        return DataLoader(_Rounds(self.total_rounds), batch_size=None, shuffle=False)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store the algorithm's server state; save the loggers, so ``metrics.csv`` holds every round
        the checkpoint holds (a resume replays only the rounds after it)."""
        checkpoint["fedfdp"] = {"algorithm": self.algorithm.state_dict(), "total_rounds": self.total_rounds}
        if self.client.local_optimizer_state == "kept":  # the clients' optimizer states (client state)
            checkpoint["fedfdp"]["local_optimizer"] = self.client.local_optimizer_states.state_dict()
        for lg in self.loggers:
            lg.save()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the algorithm's server state and note the checkpoint's round."""
        self.start_round = int(checkpoint.get("global_step", 0))
        self.algorithm.load_state_dict(checkpoint["fedfdp"]["algorithm"])
        self.client.local_optimizer_states.load_state_dict(checkpoint["fedfdp"].get("local_optimizer", {}))

    def on_fit_start(self) -> None:
        """Plan the rounds again now that any checkpoint is restored; refuse a run with none left.

        ``setup`` runs before Lightning restores a checkpoint (and the callbacks' state); here the
        rounds are planned from the checkpoint's round and the privacy ledger (which holds every
        release, those after the checkpoint included), before Lightning would silently stop at
        ``max_steps``.
        """
        self.algorithm.on_fit_start(self)
        self._plan_rounds()
        if self.start_round >= self.total_rounds and self.unfinished_run:
            # cut after its last round's checkpoint, before its end was written: evaluate the final model
            # again (deterministic) so the run's end (summary, report) is written; nothing is trained
            logger.warning("the checkpoint holds all %d rounds but the run was cut before its end was written: "
                           "finishing it (final evaluation, summary), nothing is trained", self.total_rounds)
            self.finishing = True
            self.evaluate(self.start_round)
            return
        if self.start_round >= self.total_rounds:
            raise PrivacyBudgetError(
                f"the checkpoint is at round {self.start_round} and this run allows {self.total_rounds} rounds "
                f"(model.num_rounds and the privacy budget); nothing left to train: raise model.num_rounds "
                f"if the budget allows it")

    # ---- federation ----------------------------------------------------------------------------
    @property
    def eval_batch_size(self) -> int:
        """Batch size of evaluation passes on this module's device (the configured one if set)."""
        return eval_batch_size(self._eval_batch_size, self.device)

    @property
    def num_clients(self) -> int:
        """N, the number of clients of the datamodule."""
        return self.datamodule.num_clients

    @property
    def accountant(self) -> PrivacyAccountant | None:
        """The run's privacy accountant (:class:`~fedfdp.privacy.accountant.PrivacyAccountant`:
        ``callbacks.RDPAccounting``; None for a run without one).

        The one owner of the privacy accounting: every module that needs ε, δ, the ledgers or the
        budget asks here. A second accountant in ``trainer.callbacks`` is refused at start.
        """
        if self.node_accounting is not None:
            return self.node_accounting
        if self._accountant is _NOT_SET:  # read before setup (a check of the parsed run): ask the callbacks
            return run_accountant_of(self.trainer.callbacks)
        return self._accountant  # type: ignore[return-value]

    _accountant: object = _NOT_SET  # handed over at setup by its callback (see :attr:`accountant`)

    #: Set by the owner of the run's summary (``callbacks.RunSummary``) on a resume whose run directory says
    #: the run never ended (``running``, ``interrupted``): a checkpoint that already holds every round then
    #: finishes the run (final evaluation, summary) instead of being refused with nothing left to train.
    unfinished_run: bool = False

    #: True while a resume only finishes a run cut after its last round (see :attr:`unfinished_run`).
    finishing: bool = False

    #: On a deployed node, the run's accounting callback, read there for its settings only (target
    #: ε, δ, orders: e.g. a clustered algorithm's noise calibration) and never run: the client's own
    #: ledger charges its releases (:mod:`fedfdp.flower.node`). None in a simulation and on the server.
    node_accounting: PrivacyAccountant | None = None

    @property
    def privacy_mechanism(self) -> PrivacyMechanism | None:
        """The algorithm's privacy mechanism (``algorithm.privacy``), or None."""
        mechanism = getattr(self.algorithm, "privacy", None)
        return mechanism if isinstance(mechanism, PrivacyMechanism) else None

    def planned_population_events(self) -> list[tuple[str, DPEvent]]:
        """The DP events of one round's server release charged to the whole population (client unit:
        :meth:`fedfdp.privacy.ClientLevelDP.round_events`); none for record-level mechanisms."""
        mechanism = self.privacy_mechanism
        return [] if mechanism is None else mechanism.round_events(self.num_clients)

    def federation_callbacks(self) -> list[FederationHooks]:
        """The trainer's callbacks that have federation hooks."""
        return [cb for cb in self.trainer.callbacks if isinstance(cb, FederationHooks)]

    def planned_dp_events(self, client_id: int) -> list[tuple[str, DPEvent]]:
        """Every DP event one round of ``client_id`` will charge (algorithm and callbacks)."""
        size = int(self.datamodule.train_sizes[client_id])
        events = list(self.algorithm.planned_dp_events(client_id, size))
        for cb in self.federation_callbacks():
            events.extend(cb.planned_dp_events(self, client_id))
        return events

    def sample_clients(self, round_idx: int) -> list[int]:
        """Uniform sampling without replacement (all clients when ``clients_per_round`` is null), or the
        cohort the privacy mechanism draws (client-level DP: Poisson sampling of the population)."""
        mechanism = self.privacy_mechanism
        if mechanism is not None and mechanism.releases_aggregate:
            return mechanism.cohort(self.num_clients, self.generator("cohort", round_idx))  # type: ignore[attr-defined]
        if self.clients_per_round is None or self.clients_per_round >= self.num_clients:
            return list(range(self.num_clients))
        rng = numpy_generator(self.seed, "clients", round_idx)
        return sorted(int(c) for c in rng.choice(self.num_clients, self.clients_per_round, replace=False))

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.federation_callbacks():
            getattr(cb, hook)(self.trainer, self, *args)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        """One round: broadcast, local updates, privatised uploads, aggregation, evaluation."""
        start = time.perf_counter()
        round_idx = self.current_round = int(self.global_step)
        with server_half("configure_round"):
            context = self.algorithm.configure_round(round_idx)
        client_ids = self.sample_clients(round_idx)
        self._call("on_round_start", context, client_ids)

        global_params = parameters_to_vector(trainable(self.global_model)).detach()
        updates = self.train_clients(context, client_ids, global_params)
        for update in updates:
            update.params = update.params.to(self.device)
            if not torch.isfinite(update.params).all() or (
                    update.reported_loss is not None and not math.isfinite(update.reported_loss)):
                raise DivergenceError(f"round {round_idx + 1}: client {update.client_id} produced a non-finite "
                                      f"model or loss (diverged; lower algorithm.lr?)")
        self._call("on_before_aggregate", updates)

        mechanism = self.privacy_mechanism
        if mechanism is not None and mechanism.releases_aggregate:
            # client-level DP: the mechanism clips and noises the round's sum (charged just before, by
            # on_before_aggregate); the server's half sees that release alone, no upload. An audit's
            # canaries take part in the release as clients would (callbacks.CanaryClientAudit).
            canaries = [u for cb in self.federation_callbacks()
                        for u in cb.canary_uploads(self.trainer, self, round_idx, global_params)]
            target = mechanism.release_aggregate(  # type: ignore[attr-defined]
                global_params, [*updates, *canaries], self.num_clients, self.generator("aggregate", round_idx))
            released: list[ClientUpdate] = []
        else:
            # the server's half reads what was released: the uploads without the simulation's diagnostics
            # (raw losses, realised batch sizes), which reach the logs only
            released = [dataclasses.replace(update, diagnostics={}) for update in updates]
            with server_half("aggregate"):
                target = self.algorithm.aggregate(global_params, released, context)
        optimizer = self.optimizers()
        optimizer.zero_grad()
        pseudo_grad = global_params - target
        offset = 0
        for param in trainable(self.global_model):
            n = param.numel()
            param.grad = pseudo_grad[offset:offset + n].view_as(param).clone()
            offset += n
        optimizer.step()  # increments global_step: one round done
        if self.global_ema is not None:
            self.global_ema.update_parameters(self.global_model)
        if round_idx % TRIM_EVERY == 0:
            release_freed_memory()

        with server_half("on_round_end"):
            metrics: dict[str, Any] = dict(self.algorithm.on_round_end(released, context))
        metrics.update(_mean_diagnostics(updates))
        self._call("on_round_end", context, updates, metrics)
        self._round_seconds.append(time.perf_counter() - start)
        metrics["round_seconds"] = self._round_seconds[-1]
        self._log_round({key: float(value) for key, value in metrics.items()}, round_idx, shown="epsilon")
        rounds_done = round_idx + 1
        if rounds_done % self.eval_every == 0 or rounds_done >= self.total_rounds:
            evaluation = {k: float(v) for k, v in self.evaluate(rounds_done).items()}
            self._log_round(evaluation, round_idx, shown="accuracy")

    def _log_round(self, metrics: dict[str, float], round_idx: int, shown: str) -> None:
        """Log ``metrics`` as round ``round_idx``'s row (``metrics.csv``, W&B); show ``shown`` on the bar.

        Straight to the loggers, not through ``self.log``: Lightning's result collection costs about
        a millisecond per metric and round (as much as a small model's round), and would repeat
        evaluation metrics on every later round until the next evaluation. The loggers are saved
        with every checkpoint (:meth:`on_save_checkpoint`) and when fitting ends.
        """
        row = {**metrics, "epoch": float(self.current_epoch)}
        for lg in self.loggers:
            lg.log_metrics(row, step=round_idx)
        if shown in metrics and self.trainer.progress_bar_callback is not None:
            self.log(shown, metrics[shown], prog_bar=True, logger=False, on_step=True, on_epoch=False)

    @property
    def round_seconds(self) -> list[float]:
        """Wall time of each round run in this process."""
        return list(self._round_seconds)


def _mean_diagnostics(updates: list[ClientUpdate]) -> dict[str, float]:
    """Mean over clients of each simulation diagnostic (e.g. ``negative_fraction``)."""
    keys = {k for u in updates for k in u.diagnostics}
    return {f"client_{k}": sum(u.diagnostics[k] for u in updates if k in u.diagnostics)
            / sum(1 for u in updates if k in u.diagnostics) for k in sorted(keys)}
