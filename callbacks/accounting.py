"""RDP accounting of every differentially private release, per client, with a budget guard.

The accountant is :class:`fedfdp.privacy.run_accountant.RunAccountant` (the narrow
:class:`~fedfdp.privacy.accountant.PrivacyAccountant` interface over per-client ledgers and Opacus'
RDP or PRV accountant), with its collaborators: the ledger file (``ledger``), the round planning
and guard (``budget``) and the start-up checks (:mod:`fedfdp.privacy.start_checks`). This module
makes it a Lightning callback that hands itself to the federation at setup
(:meth:`provided_accountant`); each federation hook gives the accountant and its collaborators what
they need from the run, in the federation's phase order:

* ``setup_federation``: the start-up checks (δ, every release and upload field has a guarantee,
  the model and loss keep the clipped sum's sensitivity on a probe batch), then the ledgers are rebuilt from the ledger file;
* ``max_rounds``: the rounds the budget allows; ``on_round_start``: the per-round guard;
* ``on_client_release``: the upload's fields are checked and its events written and charged;
  ``on_uploads_final``: fsynced before any upload leaves the process; ``on_before_aggregate``:
  the uploads of other processes are charged;
* ``on_round_end``: ε is logged; ``on_train_start``: a checkpoint older than ledger files is
  migrated into the file; ``teardown``: the file is closed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch import LightningModule, Trainer

from callbacks.base import FederationCallback
from fedfdp.distributed import rank_and_world
from fedfdp.privacy.probe import probe_federation_client
from fedfdp.errors import ConfigError
from fedfdp.privacy.run_accountant import AccountingMode, RunAccountant
from fedfdp.privacy.start_checks import check_delta, guarantee_problem
from fedfdp.privacy.uploads import declared_upload_privacy, describe

if TYPE_CHECKING:
    from fedfdp.federation import Federation
    from fedfdp.types import ClientUpdate, RoundContext

__all__ = ["AccountingMode", "RDPAccounting"]


class RDPAccounting(RunAccountant, FederationCallback):
    """Charges every DP event to its client's ledger; logs ε; stops before the budget is exceeded.

    Args:
        target_epsilon: the budget ε; the run stops after the last round whose events keep every
            client's ε ≤ target (None: account and log only).
        delta: δ of the (ε, δ) guarantee (paper: 1e-5).
        orders: RDP orders: ``paper`` = {2..63, 128, 256, 512} (authors' code, spec A-21) or
            ``opacus`` (Opacus' defaults).
        accounting_mode: which releases count against the budget: ``theorem2`` (model steps and
            loss releases, FedFDP Theorem 2; default) or ``model_only`` (the authors' code, for
            reproduction: the true ε, logged as ``epsilon``, then exceeds the target).
        rounds_rule: ``strict`` (largest T with ε ≤ target) or ``paper_code`` (the authors'
            bisection, which can overshoot the target by up to 0.01; 778 rounds at ε = 3.52).
        accountant: ``rdp`` (Opacus' RDPAccountant; the paper's, default) or ``prv`` (Opacus'
            PRVAccountant, Gopi et al. 2021: tighter, e.g. ε 3.23 instead of 3.52 for FedFDP's
            683 paper rounds). ε, the planned rounds and the budget guard all use it; with
            ``prv`` the RDP ε is logged beside it as ``epsilon_rdp``.
        ledger_path: the durable privacy ledger (JSON lines, fsynced before the round's releases leave
            its client); the command line sets ``<run_dir>/privacy_ledger.jsonl``. None keeps the
            ledgers in memory and in checkpoints only (library use, tests).
        allow_non_private: run releases whose guarantee does not hold (σ = 0, an unbounded clip
            rule such as ``fair_clip_mode: paper_raw``, BatchNorm) for analysis only: ε is then
            reported as infinite. Off by default: such a run is refused at start.
    """

    def provided_accountant(self) -> RunAccountant:
        """This callback is the run's accountant."""
        return self

    def setup_federation(self, trainer: Trainer, federation: Federation) -> None:
        """Refuse releases without a guarantee and a δ that guarantees nothing; rebuild the ledgers
        from the ledger file."""
        check_delta(self.delta, federation.datamodule.train_sizes)
        mechanism = federation.privacy_mechanism
        if mechanism is not None and mechanism.unit == "client":
            self.check_client_level(federation)
        releases = list(federation.algorithm.dp_releases())
        for cb in federation.federation_callbacks():
            releases.extend(cb.dp_releases(federation))
        declared = declared_upload_privacy(federation)
        problem = guarantee_problem(releases, declared, federation.client.net, type(federation.algorithm).__name__,
                                    probe_federation_client(federation, releases))
        self.record_start_checks(problem, declared)
        self.ledger.models = federation.algorithm.covered_models()
        self.ledger.open(rank_and_world()[0])

    def check_client_level(self, federation: Federation) -> None:
        """A client-level mechanism: ε is for one client of the population (δ < 1/N), the upload is
        the model alone (the mechanism releases only the noisy sum of the cohort's clipped updates),
        and one process charges the population's ledger."""
        self.set_population(federation.num_clients)
        extra = sorted(f for f in declared_upload_privacy(federation) if f != "params")
        if extra:
            raise ConfigError(f"model.algorithm {type(federation.algorithm).__name__}: the {describe(extra[0])} would "
                              f"leave each client outside fedfdp.privacy.ClientLevelDP, which releases only the noisy "
                              f"sum of the cohort's clipped model updates; remove the callback or option that adds it")
        if rank_and_world()[1] > 1:
            raise ConfigError("fedfdp.privacy.ClientLevelDP runs in one process (the population's ledger is charged "
                              "once a round): set trainer.devices: 1")

    def max_rounds(self, trainer: Trainer, federation: Federation) -> int | None:
        """The round count (from round 0) at which the budget is spent, given what is already charged
        (:meth:`~fedfdp.privacy.budget.BudgetPlan.planned_rounds`)."""
        return self.budget.planned_rounds(federation.num_clients, federation.planned_dp_events,
                                   int(getattr(federation, "start_round", 0)), federation.planned_population_events())

    def on_round_start(self, trainer: Trainer, federation: Federation, context: RoundContext,
                       client_ids: list[int]) -> None:
        """Refuse a round that would take any client (or, client-level, the population) past the budget
        (strict rule only)."""
        self.budget.check_round(context.round, client_ids, federation.planned_dp_events,
                                federation.planned_population_events())

    def on_client_release(self, trainer: Trainer, federation: Federation, update: ClientUpdate) -> None:
        """Check that every field of the upload is private, then write its events to the ledger file
        and charge them (:meth:`~fedfdp.privacy.run_accountant.RunAccountant.charge_upload`)."""
        if self.declared_uploads is None:
            self.declared_uploads = declared_upload_privacy(federation)
        self.charge_upload(federation.current_round, update)

    def on_uploads_final(self, trainer: Trainer, federation: Federation, updates: list[ClientUpdate]) -> None:
        """fsync the ledger entries of this process's uploads of the round before any upload leaves it."""
        self.ledger.sync()

    def on_before_aggregate(self, trainer: Trainer, federation: Federation,
                            updates: list[ClientUpdate]) -> None:
        """Charge the uploads that other processes released (they wrote their own ledger files); charge
        the round's release of a client-level mechanism to the population (written and fsynced before
        the mechanism makes it)."""
        self.charge_received(updates)
        population = federation.planned_population_events()
        if population:
            self.charge_population(federation.current_round, population)

    def on_round_end(self, trainer: Trainer, federation: Federation, context: RoundContext,
                     updates: list[ClientUpdate], metrics: dict[str, float]) -> None:
        """Log ε (all releases) and the budgeted ε."""
        metrics.update(self.round_metrics())

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Write checkpoint-only ledgers to the file now that no check can refuse the start; count the
        releases a cut session made after the checkpoint (:meth:`note_resume`)."""
        self.ledger.migrate()
        self.note_resume(int(getattr(pl_module, "start_round", 0)))

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Close the ledger file."""
        self.ledger.close()
