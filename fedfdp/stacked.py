"""A stacked round: the one-step private updates of all sampled clients from one engine pass.

When every sampled client takes exactly one private step from its start model (DP-FedAvg and
FedFDP with ``local_steps = 1``, the paper's setting, from ``w_t``; local-only DP-SGD and the
fine-tuning phase from each client's own model), client ``i``'s per-sample losses ``ℓ_j`` and
gradient norms ``‖g_j‖`` depend only on its start model and its own Poisson batch ``B_i``. The
round's DP step then runs as one forward and one backward pass over the union
``B = B_1 ‖ B_2 ‖ … ‖ B_K`` (clients contiguous, client ``k`` at rows ``[o_k, o_{k+1})``; clients
with different start models go through the grouped network, :mod:`fedfdp.grad_sample.grouped`):

1. per client, in client order: the Poisson mask ``B_i`` is drawn from the client's own generator
   ``generator("client", t, i)`` (its first draw, as in the per-client path);
2. one :meth:`~fedfdp.grad_sample.engine.GhostEngine.compute` on ``B`` at the start models gives every
   ``ℓ_j`` and ``‖g_j‖``; client ``k``'s factors ``s_j = rule_k(ℓ_j, ‖g_j‖)`` come from its own
   clip rule on its slice, and its clipped sum ``S_k = Σ_{j ∈ [o_k, o_{k+1})} s_j g_j`` from
   :meth:`~fedfdp.grad_sample.engine.PerSampleResult.segment_weighted_sums` (one weighted sum's
   cost for all clients);
3. per client, in client order, exactly the second half of the per-client step
   (:meth:`fedfdp.client.ClientModule.apply_private_sum`): ``G_k = S_k + N(0, (σC)² I)`` drawn
   from the same generator (its second draw), ``w_k = w_t − η G_k / n_k`` by the client's own
   optimizer (any ``local_optimizer``, with the client's kept state loaded), then the upload and the client's ``on_client_update`` / ``on_client_release``
   callbacks with ``w_k`` loaded, as :meth:`fedfdp.Federation.training_step` does per client.

Every random stream is therefore consumed as in the per-client path; the models agree up to
floating-point summation order (the batch shapes differ).

The union runs in engine passes over groups of whole consecutive clients of at most ``max_batch``
expected samples ``q|D_i|`` (:func:`group_clients`): on accelerators in effect one pass, on CPU
passes of about 512 samples, since a batch whose activations leave the cache costs more per
sample. The peak memory of a pass is that of a private step on about ``max_batch`` samples (the
engine's conv chunking bounds the per-sample buffers) plus the group's training splits; a
client's clip rule always sees its whole batch.

Several local steps (``StackedStepSpec.steps = K``, DP-FedAvg with ``local_steps = K`` and plain
SGD; or each client's own count, the clustered family's ``K·⌊N_i/b⌋`` after its cluster selection)
run in lockstep on accelerators: step ``k`` of every client with more than ``k`` steps is one pass
as above, each client at its own model after step ``k − 1``; see :meth:`StackedRound._run_group_lockstep`.

The algorithm declares the step with :meth:`fedfdp.algorithms.Algorithm.stackable_step`; the
federation falls back to the per-client path (logged once) whenever stacking could change what
runs: see :func:`unstackable_reason`.
"""

from __future__ import annotations

import logging
from itertools import accumulate
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from fedfdp.grad_sample.engine import PerSampleResult
from fedfdp.grad_sample.grouped import GroupedNetwork
from fedfdp.privacy.mechanism import MechanismTrace, resumed, tracing
from fedfdp.types import ClientUpdate, LocalBatch, RoundContext, StackedStepSpec, StepOutput

if TYPE_CHECKING:
    from fedfdp.client import ClientModule
    from fedfdp.interfaces import FederationView

logger = logging.getLogger(__name__)


def unstackable_reason(federation: FederationView) -> str | None:
    """Why this federation's round must run client by client (None when it may be stacked).

    The stacked path replaces the algorithm's ``local_update`` and the client's ``training_step``
    by their default pieces, so any override of those must run as written (an algorithm with its
    own ``local_update`` declares an equivalent stackable step itself, or none).
    """
    from fedfdp.client import ClientModule
    from fedfdp.distributed import rank_and_world
    from fedfdp.grad_sample.engine import GhostEngine

    client = federation.client
    client_type = type(client)
    for name in ("training_step", "_private_step", "clipped_sum"):
        if getattr(client_type, name) is not getattr(ClientModule, name):
            return f"{client_type.__name__} overrides ClientModule.{name}"
    if rank_and_world()[1] > 1:
        return "several processes train the clients"
    if not isinstance(client.engine, GhostEngine):
        return (f"the per-sample engine is {type(client.engine).__name__}, not GhostEngine (the union batch "
                f"would materialise every per-sample gradient)")
    return None


_CPU_MAX_BATCH = 512
"""Samples per engine pass of a stacked round on CPU. Per-sample cost grows with the batch once its
activations leave the cache: on FashionMNIST's FedAvgCNN (2-core EPYC, 32 MB L3) passes of 256-512
samples cost 1.1-1.3 ms/sample and one pass over the 2250-sample union 1.7 ms/sample (the whole
round then takes 1.27x the per-client round's time), so the union runs in groups of whole clients
of about this size."""

_ACCELERATOR_MAX_BATCH = 16384
"""The same on accelerators, where one pass over the union is the point (fewer, larger kernels);
it only bounds the memory of the activations."""


def _union(batches: list[LocalBatch]) -> tuple[Tensor, Tensor]:
    """The clients' batches one after another (one client's batch as it is: no copy)."""
    if len(batches) == 1:
        return batches[0].x, batches[0].y
    return torch.cat([b.x for b in batches]), torch.cat([b.y for b in batches])


def group_clients(batch_sizes: list[float], max_batch: int) -> list[range]:
    """Consecutive clients in groups of at most ``max_batch`` (expected) samples (a larger client alone).

    >>> group_clients([46.2, 286.1, 428.3, 117.7, 200.05, 53.25], 512)
    [range(0, 2), range(2, 3), range(3, 6)]
    """
    groups: list[range] = []
    start, total = 0, 0
    for k, size in enumerate(batch_sizes):
        if k > start and total + size > max_batch:
            groups.append(range(start, k))
            start, total = k, 0
        total += size
    if batch_sizes:
        groups.append(range(start, len(batch_sizes)))
    return groups


class StackedRound:
    """Runs a round's private steps stacked when :meth:`plan` allows it; logs each fallback reason once.

    Several local steps (``StackedStepSpec.steps > 1``) run in lockstep on accelerators only: on this
    project's CPU, DP-FedAvg's 10 steps on RC-DPFL's MNIST setting (21 clients, TinyCNN) took 4.4 s a
    round in lockstep against 3.3 client by client (same model and ε), since the per-client passes
    already fill the cores. ``lockstep_on_cpu`` (a class attribute) turns it on there (tests).

    Args:
        max_batch: samples per engine pass: the union of the clients' batches is split into groups
            of whole consecutive clients of at most this many expected samples (a client with more
            runs alone). None: 512 on CPU, 16384 on accelerators (in effect the whole union).
    """

    lockstep_on_cpu: bool = False

    def __init__(self, max_batch: int | None = None) -> None:
        self.max_batch = max_batch
        self._logged: set[str] = set()
        self._grouped: GroupedNetwork | None = None  # built once, at the first round with several start models

    def plan(self, federation: FederationView, context: RoundContext) -> StackedStepSpec | None:
        """The algorithm's stackable step for this round, or None (per-client path; reason logged once)."""
        reason = unstackable_reason(federation)
        spec = None
        if reason is None:
            spec = federation.algorithm.stackable_step(context)
            if spec is None:
                reason = (f"{type(federation.algorithm).__name__}.stackable_step returned None (a custom "
                          f"local_update, a round it runs per client such as a full-batch round, or an algorithm "
                          f"without a private step)")
        if spec is not None and spec.lockstep:
            if spec.update_steps is None:
                raise RuntimeError("a lockstep StackedStepSpec (steps > 1, client_steps or start) needs update_steps")
            steps = "per-client" if spec.client_steps is not None else str(spec.steps)
            if federation.device.type == "cpu" and not self.lockstep_on_cpu:
                reason = (f"{steps} local steps on the CPU: client by client is faster there (lockstep "
                          f"steps pay where a step is launch-bound, on accelerators)")
                spec = None
            elif not getattr(federation.client, "_plain_sgd", False):
                # a stateful optimizer (momentum, Adam) carries its state from one step of a client to
                # the next; the lockstep round rebuilds the optimizer at every step, so it runs per client
                reason = (f"{steps} local steps with a stateful local optimizer "
                          f"({type(federation.client.local_optimizer).__name__})")
                spec = None
        if reason is not None and reason not in self._logged:
            self._logged.add(reason)
            logger.info("stacked round off, clients train one by one: %s", reason)
        return spec

    def run(self, federation: FederationView, spec: StackedStepSpec, client_ids: list[int],
            global_params: Tensor, context: RoundContext) -> list[ClientUpdate]:
        """The round's uploads of ``client_ids`` (in that order), each released through the callbacks.

        Each client starts from ``algorithm.client_start_params`` (``w_t`` by default), or from what
        the spec's ``start`` returns.
        """
        sizes = federation.datamodule.train_sizes
        expected = [spec.expected_batch_size(int(sizes[cid])) for cid in client_ids]
        starts = [federation.algorithm.client_start_params(cid, global_params, context) for cid in client_ids]
        max_batch = self.max_batch or (_CPU_MAX_BATCH if federation.device.type == "cpu" else _ACCELERATOR_MAX_BATCH)
        updates: list[ClientUpdate] = []
        run_group = self._run_group_lockstep if spec.lockstep else self._run_group
        for group in group_clients(expected, max_batch):
            updates.extend(run_group(federation, spec, [client_ids[k] for k in group], [starts[k] for k in group]))
        return updates

    def _compute(self, federation: FederationView, starts: list[Tensor], batches: list[LocalBatch]) -> PerSampleResult:
        """One engine pass over the clients' batches (concatenated in order), each at its start model.

        Consecutive clients with the same start model (the same tensor) form one model group: one
        group runs through the client's own engine, several through the grouped network.
        """
        x, y = _union(batches)
        client = federation.client
        bounds = [k for k in range(len(starts)) if k == 0 or starts[k] is not starts[k - 1]]
        if len(bounds) == 1:
            client.set_flat_params(starts[0])
            return client.engine.compute(x, y)
        if self._grouped is None:
            self._grouped = GroupedNetwork(client.net, client.per_sample_loss)
        self._grouped.to(federation.device)
        ends = [*bounds[1:], len(starts)]
        sizes = [sum(int(batches[k].y.shape[0]) for k in range(lo, hi)) for lo, hi in zip(bounds, ends)]
        return self._grouped.compute(torch.stack([starts[k] for k in bounds]), sizes, x, y)

    def _clipped_sums(self, federation: FederationView, models: list[Tensor], batches: list[LocalBatch]
                      ) -> tuple[Tensor, Tensor, list[tuple[int, int]], list[Tensor], list[list[Tensor] | None]]:
        """One engine pass over the clients' batches at their models: the per-sample losses and norms,
        each client's rows ``(lo, hi)``, its clip factors (its own rule on its whole batch, with its
        diagnostics, e.g. the negative fraction) and its clipped sum ``S_k``."""
        if any(b.clip_rule is None or b.generator is None for b in batches):
            raise RuntimeError("StackedStepSpec.batch must return private batches (a clip rule and a generator)")
        offsets = list(accumulate((int(b.y.shape[0]) for b in batches), initial=0))
        result = self._compute(federation, models, batches)
        losses, norms = result.losses, result.norms
        segments = list(zip(offsets, offsets[1:]))
        factors = [b.clip_rule(losses[lo:hi], norms[lo:hi])  # type: ignore[misc]
                   for b, (lo, hi) in zip(batches, segments)]
        sums: list[list[Tensor] | None] = list(result.segment_weighted_sums(torch.cat(factors), offsets))
        del result  # the per-sample buffers are not needed any more
        return losses, norms, segments, factors, sums

    def _run_group(self, federation: FederationView, spec: StackedStepSpec, client_ids: list[int],
                   starts: list[Tensor]) -> list[ClientUpdate]:
        """One engine pass at the start models over the group's batches, then each client's step and
        release in order."""
        if spec.lockstep:  # never one step of several: _run_group_lockstep takes them all
            raise RuntimeError(f"_run_group takes one-step specs; this one is a lockstep spec ({spec.steps} steps)")
        client = federation.client
        round_idx = federation.current_round
        data = [federation.client_data(cid) for cid in client_ids]
        batches = [spec.batch(d, federation.generator("client", round_idx, cid))  # each client's first draw
                   for d, cid in zip(data, client_ids)]
        losses, norms, segments, factors, sums = self._clipped_sums(federation, starts, batches)
        updates = []
        for k, (batch, (lo, hi)) in enumerate(zip(batches, segments)):
            clipped_sum, sums[k] = sums[k], None
            assert clipped_sum is not None
            # the client's mechanism calls and release, checked before it leaves
            with tracing(client_ids[k], federation.algorithm.public_server_state):
                client.load_start_model(starts[k])
                with client.local_optimizer_for(client_ids[k]):  # fresh, or the client's kept state
                    output = client.apply_private_sum(batch, clipped_sum, losses[lo:hi], norms[lo:hi], factors[k])
                update = spec.update(client, data[k], output)
                federation.release_client_update(data[k], update)
            updates.append(update)
        return updates

    def _run_group_lockstep(self, federation: FederationView, spec: StackedStepSpec, client_ids: list[int],
                            starts: list[Tensor]) -> list[ClientUpdate]:
        """Each client's ``K_i = spec.steps_of(data)`` steps in lockstep, then its upload and release in order.

        First, per client in order, the spec's ``start`` half if it has one (e.g. a cluster
        selection: its draws come first from the client's generator, its release goes into the
        client's trace), which gives the client's start model. Step ``k`` is then one engine pass
        over the ``k``-th Poisson batches of the clients with ``K_i > k``, each client at its own
        model after step ``k - 1`` (the grouped network); per client in order, its own clip rule,
        noise, divisor and optimizer step (:meth:`ClientModule.apply_private_sum`), as in
        :meth:`_run_group`. Every client's generator gives its draws in the per-client order
        (start, batch 1, noise 1, batch 2, ...) and its mechanism calls go to one trace for the whole
        update; right after its last step its model is read as the released state. At the end, per
        client in order, that model is loaded and the upload made from its step outputs and released
        (an upload equal to the released state), as the per-client path does after its last step. The
        optimizer must be stateless (plain SGD: checked by :meth:`plan`), since it is rebuilt for
        each step.
        """
        client = federation.client
        round_idx = federation.current_round
        data = [federation.client_data(cid) for cid in client_ids]
        generators = [federation.generator("client", round_idx, cid) for cid in client_ids]
        traces = [MechanismTrace(cid, public_states=federation.algorithm.public_server_state) for cid in client_ids]
        models = list(starts)
        if spec.start is not None:
            for k, cid in enumerate(client_ids):
                with resumed(traces[k]):
                    models[k] = spec.start(client, data[k], generators[k])
        counts = [spec.steps_of(d) for d in data]
        outputs: list[list[StepOutput]] = [[] for _ in client_ids]
        for step in range(max(counts, default=0)):
            active = [k for k, count in enumerate(counts) if count > step]
            batches = []
            for k in active:  # in the client's trace: what a step's batch half releases (e.g. the
                with resumed(traces[k]):  # previous step's count) is the client's
                    batches.append(spec.batch(data[k], generators[k]))
            losses, norms, segments, factors, sums = self._clipped_sums(federation, [models[k] for k in active],
                                                                        batches)
            for j, (k, batch, (lo, hi)) in enumerate(zip(active, batches, segments)):
                clipped_sum, sums[j] = sums[j], None
                assert clipped_sum is not None
                with resumed(traces[k]):
                    if step == 0:  # the start model (after the spec's start half, e.g. a cluster selection)
                        client.load_start_model(models[k])
                    else:
                        client.set_flat_params(models[k])
                    with client.local_optimizer_for(client_ids[k]):
                        outputs[k].append(client.apply_private_sum(batch, clipped_sum, losses[lo:hi], norms[lo:hi],
                                                                   factors[j]))
                    # the released model state after this step, read (and noted in the client's trace)
                    # before any other model is loaded: the next step's start, or the upload
                    models[k] = client.get_flat_params()
        updates: list[ClientUpdate] = []
        for k, cid in enumerate(client_ids):  # uploads and releases in client order, each with its model loaded
            with resumed(traces[k]):
                client.set_flat_params(models[k])
                update = spec.update_steps(client, data[k], outputs[k])  # type: ignore[misc]
                federation.release_client_update(data[k], update)
            updates.append(update)
        return updates
