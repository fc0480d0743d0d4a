"""The run's privacy accountant: per-client RDP (or PRV) accounting of every release, with a budget.

Privacy unit: one record of one client's data (sample-level DP per client, spec §3.1). Each
client has ledgers (:class:`fedfdp.privacy.ledger.RunLedger`, over Opacus' ``RDPAccountant``);
every upload's ``dp_events`` (a Poisson-sampled Gaussian event per gradient step, one per loss
release) are charged when the client's upload is final, before it leaves the client. The
reported ε is the maximum over clients.

With a ``ledger_path`` (the command line sets ``<run_dir>/privacy_ledger.jsonl``) every charge
is first appended to that file (:mod:`fedfdp.privacy.ledger_file`) and fsynced, with the round's
other charges, before any upload leaves the process (:meth:`RunAccountant.sync`), and the
ledgers, ε, the budget guard and the planned rounds always come from the file: a run resumed from
any checkpoint, or restarted after a crash before its first checkpoint, keeps every release it
made, and the rounds it replays are charged again.

:class:`RunAccountant` implements the narrow :class:`fedfdp.privacy.accountant.PrivacyAccountant`
(compose an event, ε, would the next events exceed the budget, state) and knows neither Lightning
nor the federation. Its collaborators: the ledgers and their durable file (``ledger``,
:class:`fedfdp.privacy.ledger.RunLedger`), the round planning and the per-round guard (``budget``,
:class:`fedfdp.privacy.budget.BudgetPlan`) and the start-up checks
(:mod:`fedfdp.privacy.start_checks`, whose outcome :meth:`RunAccountant.record_start_checks` keeps:
a release whose guarantee would not hold is refused at start, or with ``allow_non_private`` makes
ε infinite). ``callbacks.RDPAccounting`` calls them from the federation's hooks.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from fedfdp.errors import ConfigError, PrivacyBudgetError, PrivacyError, require
from fedfdp.privacy.accounting import ACCOUNTANTS, OPACUS_DEFAULT_ORDERS, PAPER_ORDERS, Accountant, DPEvent
from fedfdp.privacy.budget import BudgetPlan
from fedfdp.privacy.ledger import AccountingMode, RunLedger
from fedfdp.privacy.start_checks import check_population_delta
from fedfdp.privacy.uploads import unprotected_fields
from fedfdp.types import POPULATION

if TYPE_CHECKING:
    from fedfdp.privacy.accounting import PrivacyLedger
    from fedfdp.types import ClientUpdate

logger = logging.getLogger(__name__)

__all__ = ["AccountingMode", "RunAccountant"]


class RunAccountant:
    """Charges every DP event to its client's ledger; reports ε; plans and guards the budget.

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

    def __init__(self, *, target_epsilon: float | None = None, delta: float = 1e-5,
                 orders: Literal["paper", "opacus"] = "paper", accounting_mode: AccountingMode = "theorem2",
                 rounds_rule: Literal["strict", "paper_code"] = "strict", accountant: Accountant = "rdp",
                 ledger_path: str | None = None, allow_non_private: bool = False) -> None:
        require(target_epsilon is None or target_epsilon > 0,
                f"RDPAccounting.target_epsilon must be > 0 or null, got {target_epsilon}")
        require(0 < delta < 1, f"RDPAccounting.delta must be in (0, 1), got {delta}")
        require(orders in ("paper", "opacus"), f"RDPAccounting.orders must be 'paper' or 'opacus', got {orders!r}")
        require(accounting_mode in ("theorem2", "model_only"),
                f"RDPAccounting.accounting_mode must be 'theorem2' or 'model_only', got {accounting_mode!r}")
        require(rounds_rule in ("strict", "paper_code"),
                f"RDPAccounting.rounds_rule must be 'strict' or 'paper_code', got {rounds_rule!r}")
        require(accountant in ACCOUNTANTS, f"RDPAccounting.accountant must be one of {list(ACCOUNTANTS)}, "
                                           f"got {accountant!r}")
        require(accountant == "rdp" or rounds_rule == "strict",
                "RDPAccounting.rounds_rule paper_code is the authors' RDP bisection: use rounds_rule strict "
                "with accountant prv")
        self.target_epsilon = target_epsilon
        self.delta = delta
        self.orders: tuple[float, ...] = PAPER_ORDERS if orders == "paper" else OPACUS_DEFAULT_ORDERS
        self.accounting_mode: AccountingMode = accounting_mode
        self.rounds_rule = rounds_rule
        self.accountant: Accountant = accountant
        self.allow_non_private = allow_non_private
        self.unbounded = False  # a release without a guarantee is configured (allow_non_private): ε is infinite
        self.guarantee_checked = False  # set once every release and upload field was checked at start
        self.declared_uploads: dict[str, str | None] | None = None  # upload field -> how it is private
        self._charged: set[int] = set()  # clients of the current round charged by charge_upload
        self.repeated_releases = 0  # releases charged twice: made after a checkpoint, again on resume
        self.population_size: int | None = None  # N, when a client-level mechanism runs (:meth:`set_population`)
        self.ledger = RunLedger(orders=self.orders, delta=delta, mode=accounting_mode, accountant_kind=accountant,
                                path=ledger_path)
        self.budget = BudgetPlan(self)

    # ---- settings and reading -------------------------------------------------------------------
    @property
    def ledger_path(self) -> str | None:
        """The durable ledger file (None: in memory and checkpoints only)."""
        return self.ledger.path

    @ledger_path.setter
    def ledger_path(self, path: str | None) -> None:
        self.ledger.path = path

    @property
    def ledgers(self) -> dict[int, PrivacyLedger]:
        """Every client's ledger of all its releases."""
        return self.ledger.ledgers

    @property
    def budget_ledgers(self) -> dict[int, PrivacyLedger]:
        """Every client's ledger of the releases the budget counts."""
        return self.ledger.budget_ledgers

    @property
    def unit(self) -> str:
        """What the run's ε hides: ``client`` (a client-level mechanism runs) or ``record``."""
        return "record" if self.population_size is None else "client"

    def epsilon(self) -> float:
        """ε spent so far (all releases) in the run's :attr:`unit`: for one client of the population
        (the population's ledger), or for one record (the maximum over the clients' ledgers); inf for
        a run without a guarantee."""
        if self.unbounded:
            return math.inf
        return self.ledger.epsilon() if self.population_size is None else self.ledger.population_epsilon()

    def population_rounds(self) -> int:
        """The client-unit releases charged so far (rounds of a client-level mechanism)."""
        led = self.ledger.ledgers.get(POPULATION)
        return sum(e.steps for e in led.events) if led is not None else 0

    def record_epsilon(self) -> float:
        """ε for one record of any client: the clients' own ledgers; with a client-level mechanism the
        better of that and the client ε (hiding a client hides each of its records), the client ε
        alone when no record-level release was made."""
        if self.unbounded:
            return math.inf
        if self.population_size is None:
            return self.ledger.epsilon()
        client = self.ledger.population_epsilon()
        return min(client, self.ledger.epsilon()) if self.ledger.has_record_events() else client

    def budgeted_epsilon(self) -> float:
        """ε spent so far by the releases that ``accounting_mode`` counts, in the run's :attr:`unit`."""
        if self.population_size is not None:
            return self.ledger.population_epsilon(budgeted=True)
        return self.ledger.budgeted_epsilon()

    def client_epsilon(self, client_id: int) -> float:
        """ε spent so far by one client (all releases; 0 for a client that never trained)."""
        return math.inf if self.unbounded else self.ledger.client_epsilon(client_id)

    def epsilon_rdp(self) -> float:
        """ε spent so far (all releases) by the RDP accountant in the run's unit (for comparison)."""
        return math.inf if self.unbounded else self.ledger.epsilon_rdp(population=self.population_size is not None)

    def round_metrics(self) -> dict[str, float]:
        """What a round logs: ``epsilon``, and ``epsilon_budgeted`` / ``epsilon_rdp`` where they differ."""
        metrics = {"epsilon": self.epsilon()}
        if self.accounting_mode != "theorem2":
            metrics["epsilon_budgeted"] = self.budgeted_epsilon()
        if self.accountant != "rdp":
            metrics["epsilon_rdp"] = self.epsilon_rdp()
        return metrics

    @property
    def guarantee_holds(self) -> bool:
        """Whether the run's (ε, δ) claim holds: every release and upload field was checked at start,
        and none ran without a guarantee (``allow_non_private``)."""
        return self.guarantee_checked and not self.unbounded

    def mark_non_private(self) -> None:
        """A release without a guarantee ran (allowed by ``allow_non_private``): ε is infinite from now on."""
        self.unbounded = True

    # ---- start ------------------------------------------------------------------------------
    def set_population(self, num_clients: int) -> None:
        """A client-level mechanism runs over a population of ``num_clients``: ε is for one client, and
        δ must be below 1/N (:func:`fedfdp.privacy.start_checks.check_population_delta`)."""
        check_population_delta(self.delta, num_clients)
        self.population_size = num_clients

    def record_start_checks(self, problem: ConfigError | None, declared: dict[str, str | None]) -> None:
        """Keep the outcome of the start-up checks (:func:`fedfdp.privacy.start_checks.guarantee_problem`)
        and the declared upload fields (checked at every upload): a problem refuses the run, or with
        ``allow_non_private`` makes ε infinite."""
        self.declared_uploads = declared
        if problem is not None:
            if not self.allow_non_private:
                raise problem
            logger.warning("RDPAccounting.allow_non_private: %s. epsilon is reported as inf", problem)
            self.unbounded = True
        self.guarantee_checked = True

    def note_resume(self, start_round: int) -> int:
        """Count the releases the ledger file holds from round ``start_round`` on (the checkpoint's):
        a cut session made them after its last checkpoint, they stay charged (fail-closed: they were
        made), and their rounds release again, so the budget may allow fewer rounds than an
        uninterrupted run. Added to :attr:`repeated_releases` (``summary.json``) and warned; the count."""
        repeated = self.ledger.releases_since(start_round)
        if repeated:
            self.repeated_releases += repeated
            logger.warning(
                "the privacy ledger holds %d releases made after the checkpoint (round %d) by a session that was cut "
                "mid-round: they stay charged and their rounds release again, so this run may end rounds earlier "
                "than an uninterrupted one (%d releases repeated in all); stop runs with one SIGTERM or Ctrl-C, "
                "which ends the round first", repeated, start_round, self.repeated_releases)
        return repeated

    # ---- the budget ---------------------------------------------------------------------------
    def projected_epsilon(self, client_id: int, events: Sequence[tuple[str, DPEvent]]) -> float:
        """The budgeted ε of ``client_id`` (:data:`~fedfdp.types.POPULATION` for the population) once
        ``events`` are charged too (those the budget counts)."""
        return self.ledger.budget_ledger(client_id).projected_epsilon(self.ledger.counted(events), self.delta)

    def would_exceed(self, client_id: int, events: Sequence[tuple[str, DPEvent]]) -> bool:
        """Whether charging ``events`` would take ``client_id`` (or the population) past ``target_epsilon``."""
        return self.target_epsilon is not None and self.projected_epsilon(client_id, events) > self.target_epsilon

    def start_round_charges(self) -> None:
        """A round starts: no upload of it is charged yet (:meth:`charge_received` charges the others')."""
        self._charged.clear()

    # ---- charging ---------------------------------------------------------------------------
    def charge_upload(self, round_idx: int, update: ClientUpdate) -> None:
        """Check that every field of the upload is private, then write its events to the ledger file
        (fsynced with the round's others before any upload leaves, :meth:`sync`) and charge them.

        Raises:
            PrivacyError: a field of the upload is not covered by a declared and charged release (it
                does not leave: the run stops), unless ``allow_non_private`` (then ε is infinite).
            PrivacyBudgetError: the upload takes its client past the budget (more than the round's
                planned events; strict rule).
        """
        problems = unprotected_fields(update, self.declared_uploads or {})
        if problems:
            if not self.allow_non_private:
                raise PrivacyError(f"round {round_idx + 1}: client {update.client_id}'s upload carries "
                                   f"{problems[0]}, which no declared and charged DP release covers; it was not "
                                   f"released (declare it in the algorithm's upload_privacy, or set "
                                   f"RDPAccounting.allow_non_private: true for analysis)")
            self.unbounded = True
        self.ledger.charge(round_idx, update.client_id, update.dp_events, sync=False)
        self._charged.add(update.client_id)
        spent = self.ledger.client_budgeted_epsilon(update.client_id)
        if self.population_size is None and self.target_epsilon is not None and self.rounds_rule == "strict" \
                and spent > self.target_epsilon:  # (with a client-level mechanism the budget is the client unit's)
            # the round's guard projected the planned events; an upload that charges more (a planning
            # bug) must not take the run past its budget: charged, but not released
            raise PrivacyBudgetError(
                f"round {round_idx + 1}: client {update.client_id}'s upload charges epsilon "
                f"{spent:.4f}, over RDPAccounting.target_epsilon={self.target_epsilon} (more than the round's "
                f"planned DP events); it was not released")

    def charge_received(self, updates: Sequence[ClientUpdate]) -> None:
        """Charge the uploads that other processes released (they wrote their own ledger files)."""
        others = [u for u in updates if u.client_id not in self._charged]
        for update in others:
            self.ledger.record(update.client_id, update.dp_events)
        self.ledger.refresh({u.client_id for u in others})
        self._charged.clear()

    def charge_population(self, round_idx: int, events: Sequence[tuple[str, DPEvent]]) -> None:
        """Charge the round's release to the population's ledger (client unit), written and fsynced
        before the release is made.

        Raises:
            PrivacyBudgetError: the release takes the population past ``target_epsilon`` (strict rule).
        """
        self.ledger.charge(round_idx, POPULATION, events)
        spent = self.ledger.population_epsilon(budgeted=True)
        if self.target_epsilon is not None and self.rounds_rule == "strict" and spent > self.target_epsilon:
            raise PrivacyBudgetError(f"round {round_idx + 1}: the aggregate charges epsilon {spent:.4f} per client, "
                                     f"over RDPAccounting.target_epsilon={self.target_epsilon}; it was not released")

    def compose(self, client_id: int, events: Sequence[tuple[str, DPEvent]], *, round_idx: int) -> None:
        """Charge a release a client makes outside its uploads (once, e.g. a noisy label histogram
        before training), before it is used: written to the ledger file (fsynced), then charged.

        Called before the rounds are planned (``Algorithm.on_fit_start``), it is part of what the
        budget planning finds already spent, so the run trains as many rounds as still fit.
        ``round_idx``: the round it is recorded under (the run's start round).

        Raises:
            PrivacyBudgetError: the release alone takes the client past ``target_epsilon``.
        """
        self.ledger.charge(round_idx, client_id, events)
        spent = self.ledger.client_budgeted_epsilon(client_id)
        if self.target_epsilon is not None and spent > self.target_epsilon:
            raise PrivacyBudgetError(f"client {client_id}'s one-off release spends epsilon {spent:.4f}, over "
                                     f"RDPAccounting.target_epsilon={self.target_epsilon}")

    # ---- persistence ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every ledger's history (a copy: with a ledger file, the file is the source of truth)."""
        return {"unbounded": self.unbounded, "repeated_releases": self.repeated_releases, **self.ledger.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the ledgers from a checkpoint, unless the ledger file already holds them.

        The file holds every release, including those after the checkpoint, so it wins. A checkpoint
        written before ledger files existed (an empty file) is migrated into it
        (``ledger.migrate()``, once no check can refuse the start).
        """
        self.unbounded = self.unbounded or bool(state_dict.get("unbounded", False))
        self.repeated_releases = int(state_dict.get("repeated_releases", 0))
        self.ledger.load_state_dict(state_dict)
