"""RDP accounting of every differentially private release, per client, with a budget guard.

Privacy unit: one record of one client's data (sample-level DP per client, spec §3.1). Each
client has a :class:`fedfdp.privacy.accounting.PrivacyLedger` (Opacus ``RDPAccountant``); every
upload's ``dp_events`` (a Poisson-sampled Gaussian event per gradient step, one per loss
release) are charged when the client's upload is final, before it leaves the client. The
reported ε is the maximum over clients.

With a ``ledger_path`` (the command line sets ``<run_dir>/privacy_ledger.jsonl``) every charge
is first appended to that file (:mod:`fedfdp.privacy.ledger_file`) and fsynced, with the round's
other charges, before any upload leaves the process (``on_uploads_final``), and the ledgers,
ε, the budget guard and the planned rounds always come from the file: a run resumed from any
checkpoint, or restarted after a crash before its first checkpoint, keeps every release it made,
and the rounds it replays are charged again.

At start the accountant refuses any configured release whose guarantee would not hold: σ = 0 or
an unbounded clip (:func:`fedfdp.privacy.validation.check_releases`), or a model with layers
that mix the samples of a batch (BatchNorm).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch import LightningModule, Trainer

from callbacks.base import FederationCallback
from fedfdp.distributed import rank_and_world
from fedfdp.errors import ConfigError, PrivacyBudgetError, PrivacyError, require
from fedfdp.plan import MAX_ROUNDS
from fedfdp.privacy.accounting import (ACCOUNTANTS, OPACUS_DEFAULT_ORDERS, PAPER_ORDERS, Accountant, DPEvent,
                                      PrivacyLedger, epsilon_of, max_rounds, uncovered_steps)
from fedfdp.privacy.ledger_file import LedgerEntry, LedgerFile, checkpoint_entries
from fedfdp.privacy.uploads import declared_upload_privacy, unprotected_declarations, unprotected_fields
from fedfdp.privacy.validation import check_releases, sample_mixing_layers
from fedfdp.types import MODEL_RELEASE, ClientUpdate, RoundContext

if TYPE_CHECKING:
    from fedfdp.federation import Federation

logger = logging.getLogger(__name__)

AccountingMode = Literal["theorem2", "model_only"]


class RDPAccounting(FederationCallback):
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

    is_privacy_accountant = True

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
        self.orders = PAPER_ORDERS if orders == "paper" else OPACUS_DEFAULT_ORDERS
        self.accounting_mode = accounting_mode
        self.rounds_rule = rounds_rule
        self.accountant = accountant
        self.ledger_path = ledger_path
        self.allow_non_private = allow_non_private
        self.unbounded = False  # a release without a guarantee is configured (allow_non_private): ε is infinite
        self.guarantee_checked = False  # set once every release and upload field was checked at start
        self._declared: dict[str, str | None] | None = None  # upload field -> how it is private
        self._file: LedgerFile | None = None
        self._migrate = False  # checkpoint-only ledgers to write to the ledger file once training starts
        self._charged: set[int] = set()  # clients of the current round charged by on_client_release
        self.ledgers: dict[int, PrivacyLedger] = {}           # every release
        self.budget_ledgers: dict[int, PrivacyLedger] = {}    # releases counted by accounting_mode
        # ε of each ledger, refreshed only when the ledger changes: a round costs O(sampled
        # clients), not O(clients that ever trained) RDP-to-ε conversions (~0.5 ms each)
        self._spent: dict[int, float] = {}
        self._budget_spent: dict[int, float] = {}

    # ---- helpers ----------------------------------------------------------------------------
    def _counted(self, events: list[tuple[str, DPEvent]]) -> list[DPEvent]:
        if self.accounting_mode == "model_only":
            return [e for kind, e in events if kind == MODEL_RELEASE]
        return [e for _, e in events]

    def _ledger(self, store: dict[int, PrivacyLedger], client_id: int) -> PrivacyLedger:
        if client_id not in store:  # created lazily: memory only for clients that trained
            store[client_id] = PrivacyLedger(orders=self.orders, accountant_kind=self.accountant)
        return store[client_id]

    def _record(self, client_id: int, events: list[tuple[str, DPEvent]]) -> None:
        """Charge ``events`` to the in-memory ledgers of ``client_id``."""
        for _, event in events:
            self._ledger(self.ledgers, client_id).record(event)
        for event in self._counted(events):
            self._ledger(self.budget_ledgers, client_id).record(event)

    def epsilon(self) -> float:
        """ε spent so far (all releases), maximum over clients (inf for a run without a guarantee)."""
        if self.unbounded:
            return math.inf
        return max(self._spent.values(), default=0.0)

    def budgeted_epsilon(self) -> float:
        """ε spent so far by the releases that ``accounting_mode`` counts, maximum over clients."""
        return max(self._budget_spent.values(), default=0.0)

    def client_epsilon(self, client_id: int) -> float:
        """ε spent so far by one client (all releases; 0 for a client that never trained)."""
        return math.inf if self.unbounded else self._spent.get(client_id, 0.0)

    def _refresh(self, client_ids: Any) -> None:
        for cid in client_ids:
            if cid in self.ledgers:
                self._spent[cid] = self.ledgers[cid].epsilon(self.delta)
            if cid in self.budget_ledgers:
                self._budget_spent[cid] = self.budget_ledgers[cid].epsilon(self.delta)

    def _reset(self) -> None:
        self.ledgers.clear()
        self.budget_ledgers.clear()
        self._spent.clear()
        self._budget_spent.clear()

    # ---- start ------------------------------------------------------------------------------
    def setup_federation(self, trainer: Trainer, federation: Federation) -> None:
        """Refuse releases without a guarantee and a δ that guarantees nothing; rebuild the ledgers
        from the ledger file."""
        self._check_delta(federation)
        self._check_guarantee(federation)
        if self.ledger_path is None:
            return
        if self._file is not None:
            self._file.close()
        self._file = LedgerFile(self.ledger_path, rank=rank_and_world()[0])
        entries = self._file.read()
        self._reset()
        by_client: dict[int, list[tuple[str, DPEvent]]] = {}
        for entry in entries:
            by_client.setdefault(entry.client, []).append((entry.kind, entry.event))
        for cid, events in by_client.items():
            self._record(cid, events)
        self._refresh(by_client)
        if entries:
            logger.info("privacy ledger %s: %d earlier releases of %d clients charged (epsilon %.4f so far)",
                        self.ledger_path, len(entries), len(by_client), self.epsilon())

    def _check_delta(self, federation: Federation) -> None:
        """Refuse δ ≥ 1/n, n the smallest client's training set: releasing one random record of it
        outright is already (0, 1/n)-DP, so such a δ guarantees nothing (Dwork & Roth 2014, §2.3)."""
        sizes = [int(n) for n in federation.datamodule.train_sizes if int(n) > 0]
        if not sizes:
            return
        n = min(sizes)
        if not self.delta < 1.0 / n:
            raise ConfigError(f"RDPAccounting.delta={self.delta:g} guarantees nothing: it must be in (0, 1/n) with n = "
                              f"{n}, the smallest client's training set (1/n = {1.0 / n:.3g}); the papers use 1e-5")

    def _check_guarantee(self, federation: Federation) -> None:
        """Every configured release is noised and bounded, no layer mixes samples, and every field of
        the uploads is declared private (:mod:`fedfdp.privacy.uploads`): else refuse, or with
        ``allow_non_private`` report ε as infinite."""
        releases = list(federation.algorithm.dp_releases())
        for cb in federation.federation_callbacks():
            releases.extend(cb.dp_releases(federation))
        self._declared = declared_upload_privacy(federation)
        try:
            problems = unprotected_declarations(self._declared, releases)
            if problems:
                raise ConfigError(
                    f"model.algorithm {type(federation.algorithm).__name__}: {problems[0]}, but trainer.callbacks "
                    f"has callbacks.RDPAccounting, which would report an epsilon for the run; use a DP algorithm "
                    f"(DPFedAvg, FedFDP, DPFedProx, ...) with its DP callbacks, or remove the DP callbacks, or set "
                    f"RDPAccounting.allow_non_private: true to run it for analysis (epsilon inf, dp_valid false)")
            check_releases(releases)
            mixing = sample_mixing_layers(federation.client.net)
            if mixing:
                raise ConfigError(
                    f"model.client.init_args.net has layers that mix the samples of a batch ({', '.join(mixing)}: "
                    f"BatchNorm), so one record moves the others' gradients and losses and no release is "
                    f"differentially private; use GroupNorm/LayerNorm, or set "
                    f"model.client.init_args.replace_batchnorm: true to replace them with GroupNorm")
        except ConfigError as err:
            if not self.allow_non_private:
                raise
            logger.warning("RDPAccounting.allow_non_private: %s. epsilon is reported as inf", err)
            self.unbounded = True
        self.guarantee_checked = True

    @property
    def guarantee_holds(self) -> bool:
        """Whether the run's (ε, δ) claim holds: every release and upload field was checked at start,
        and none ran without a guarantee (``allow_non_private``)."""
        return self.guarantee_checked and not self.unbounded

    # ---- federation hooks -------------------------------------------------------------------
    def max_rounds(self, trainer: Trainer, federation: Federation) -> int | None:
        """The round count (from round 0) at which the budget is spent, given what is already charged.

        ``federation.start_round`` rounds are done (the checkpoint's round, 0 for a fresh start);
        the ledgers already hold every release made so far, replayed rounds included. The rounds
        still affordable are those that keep every client's ε ≤ target if it takes part in each.
        """
        if self.target_epsilon is None:
            return None
        limits: dict[tuple[Any, ...], int] = {}  # clients with equal plans and histories share one search
        for cid in range(federation.num_clients):
            events = tuple(self._counted(federation.planned_dp_events(cid)))
            if not events:
                raise ConfigError("RDPAccounting.target_epsilon is set but the run releases nothing private "
                                  "(noise_multiplier 0?); set target_epsilon: null or a noise multiplier > 0")
            spent = self.budget_ledgers[cid].events if cid in self.budget_ledgers else ()
            key = (events, spent)
            if key not in limits:
                limits[key] = max_rounds(events, target_epsilon=self.target_epsilon, delta=self.delta,
                                         orders=self.orders, rule=self.rounds_rule, spent=spent,
                                         accountant=self.accountant, cap=MAX_ROUNDS)
        remaining = min(limits.values())
        start = int(getattr(federation, "start_round", 0))
        if remaining == 0:
            spent_eps = self.budgeted_epsilon()
            if spent_eps > 0:
                raise PrivacyBudgetError(
                    f"the privacy ledger already holds epsilon={spent_eps:.4f} of RDPAccounting.target_epsilon="
                    f"{self.target_epsilon}; not one more round fits: nothing left to train")
            (events, _), = [key for key, limit in limits.items() if limit == 0][:1]
            one_round = epsilon_of(events, self.delta, self.orders, self.accountant)
            raise PrivacyBudgetError(f"RDPAccounting.target_epsilon={self.target_epsilon} is too small for a "
                                     f"single round at delta={self.delta}: one round spends epsilon={one_round:.4g}; "
                                     f"raise target_epsilon above it or the noise multiplier")
        return start + remaining

    def on_round_start(self, trainer: Trainer, federation: Federation, context: RoundContext,
                       client_ids: list[int]) -> None:
        """Refuse a round that would take any client past the budget (strict rule only)."""
        self._charged.clear()
        if self.target_epsilon is None or self.rounds_rule != "strict":
            return
        for cid in client_ids:
            projected = self._ledger(self.budget_ledgers, cid).projected_epsilon(
                self._counted(federation.planned_dp_events(cid)), self.delta)
            if projected > self.target_epsilon:
                raise PrivacyBudgetError(
                    f"round {context.round} would spend epsilon={projected:.4f} for client {cid}, over "
                    f"RDPAccounting.target_epsilon={self.target_epsilon}; the budget is exhausted")

    def on_client_release(self, trainer: Trainer, federation: Federation, update: ClientUpdate) -> None:
        """Check that every field of the upload is private, then write its events to the ledger file
        (fsynced with the round's others before any upload leaves, ``on_uploads_final``) and charge
        them.

        Raises:
            PrivacyError: a field of the upload is not covered by a declared and charged release (it
                does not leave: the run stops), unless ``allow_non_private`` (then ε is infinite).
        """
        if self._declared is None:
            self._declared = declared_upload_privacy(federation)
        problems = unprotected_fields(update, self._declared)
        if problems:
            if not self.allow_non_private:
                raise PrivacyError(f"round {federation.current_round + 1}: client {update.client_id}'s upload carries "
                                   f"{problems[0]}, which no declared and charged DP release covers; it was not "
                                   f"released (declare it in the algorithm's upload_privacy, or set "
                                   f"RDPAccounting.allow_non_private: true for analysis)")
            self.unbounded = True
        if self._file is not None:  # written now, fsynced with the round's others (on_uploads_final)
            self._file.append([LedgerEntry(round=federation.current_round, client=update.client_id, kind=kind,
                                           event=event) for kind, event in update.dp_events], sync=False)
        self._record(update.client_id, update.dp_events)
        self._charged.add(update.client_id)
        self._refresh((update.client_id,))
        spent = self._budget_spent.get(update.client_id, 0.0)
        if self.target_epsilon is not None and self.rounds_rule == "strict" and spent > self.target_epsilon:
            # the round's guard projected the planned events; an upload that charges more (a planning
            # bug) must not take the run past its budget: charged, but not released
            raise PrivacyBudgetError(
                f"round {federation.current_round + 1}: client {update.client_id}'s upload charges epsilon "
                f"{spent:.4f}, over RDPAccounting.target_epsilon={self.target_epsilon} (more than the round's "
                f"planned DP events); it was not released")

    def on_uploads_final(self, trainer: Trainer, federation: Federation, updates: list[ClientUpdate]) -> None:
        """fsync the ledger entries of this process's uploads of the round before any upload leaves it."""
        if self._file is not None:
            self._file.sync()

    def charge_release(self, federation: Federation, client_id: int, events: list[tuple[str, DPEvent]]) -> None:
        """Charge a release a client makes outside its uploads (once, e.g. a noisy label histogram
        before training), before it is used: written to the ledger file (fsynced), then charged.

        Called before the rounds are planned (``Algorithm.on_fit_start``), it is part of what the
        budget planning finds already spent, so the run trains as many rounds as still fit.

        Raises:
            PrivacyBudgetError: the release alone takes the client past ``target_epsilon``.
        """
        if self._file is not None:
            self._file.append([LedgerEntry(round=federation.start_round, client=client_id, kind=kind, event=event)
                               for kind, event in events])
        self._record(client_id, events)
        self._refresh((client_id,))
        spent = self._budget_spent.get(client_id, 0.0)
        if self.target_epsilon is not None and spent > self.target_epsilon:
            raise PrivacyBudgetError(f"client {client_id}'s one-off release spends epsilon {spent:.4f}, over "
                                     f"RDPAccounting.target_epsilon={self.target_epsilon}")

    def on_before_aggregate(self, trainer: Trainer, federation: Federation,
                            updates: list[ClientUpdate]) -> None:
        """Charge the uploads that other processes released (they wrote their own ledger files)."""
        others = [u for u in updates if u.client_id not in self._charged]
        for update in others:
            self._record(update.client_id, update.dp_events)
        self._refresh({u.client_id for u in others})
        self._charged.clear()

    def on_round_end(self, trainer: Trainer, federation: Federation, context: RoundContext,
                     updates: list[ClientUpdate], metrics: dict[str, float]) -> None:
        """Log ε (all releases) and the budgeted ε."""
        metrics["epsilon"] = self.epsilon()
        if self.accounting_mode != "theorem2":
            metrics["epsilon_budgeted"] = self.budgeted_epsilon()
        if self.accountant != "rdp":
            metrics["epsilon_rdp"] = self.epsilon_rdp()

    def epsilon_rdp(self) -> float:
        """ε spent so far (all releases) by the RDP accountant, maximum over clients (for comparison)."""
        if self.unbounded:
            return math.inf
        return max((epsilon_of(led.events, self.delta, self.orders) for led in self.ledgers.values()), default=0.0)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Close the ledger file."""
        if self._file is not None:
            self._file.close()

    # ---- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every ledger's history (a copy: with a ledger file, the file is the source of truth)."""
        return {"unbounded": self.unbounded,
                "ledgers": {cid: led.state_dict() for cid, led in self.ledgers.items()},
                "budget_ledgers": {cid: led.state_dict() for cid, led in self.budget_ledgers.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the ledgers from a checkpoint, unless the ledger file already holds them.

        The file holds every release, including those after the checkpoint, so it wins. A checkpoint
        written before ledger files existed (an empty file) is migrated into it (:meth:`on_train_start`).
        """
        self.unbounded = self.unbounded or bool(state_dict.get("unbounded", False))
        if self._file is not None and self.ledgers:
            self._check_file_covers(state_dict["ledgers"])
            return
        self._reset()
        for key, store in (("ledgers", self.ledgers), ("budget_ledgers", self.budget_ledgers)):
            for cid, led_state in state_dict[key].items():
                self._ledger(store, int(cid)).load_state_dict(led_state)
        self._refresh(set(self.ledgers) | set(self.budget_ledgers))
        self._migrate = self._file is not None and bool(self.ledgers)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Write checkpoint-only ledgers to the file now that no check can refuse the start (they are
        restored before a resume's last checks, and a refused resume must change no file)."""
        if self._migrate:
            self._migrate_to_file()

    def _check_file_covers(self, checkpoint_ledgers: dict[Any, dict[str, Any]]) -> None:
        """Refuse a ledger file that lacks releases the checkpoint recorded (truncated, or another run's).

        The file is the single source of truth and a checkpoint only a copy of it at one round, so
        every charge in the checkpoint must be in the file; resuming from a file that forgot some
        would report less ε than was spent.
        """
        for cid, led_state in checkpoint_ledgers.items():
            recorded = [DPEvent(noise_multiplier=s, sample_rate=q, steps=n) for s, q, n in led_state["history"]]
            in_file = self.ledgers[int(cid)].events if int(cid) in self.ledgers else ()
            missing = uncovered_steps(recorded, in_file)
            if missing:
                raise PrivacyError(f"privacy ledger {self.ledger_path} lacks {missing} mechanism steps of client {cid} "
                                   "that the checkpoint recorded (truncated, or another run's ledger): refusing to "
                                   "resume with spent budget forgotten")

    def _migrate_to_file(self) -> None:
        """Write checkpoint-only ledgers to the ledger file (round -1: before ledger files existed)."""
        assert self._file is not None
        self._migrate = False
        entries = checkpoint_entries({c: list(led.events) for c, led in self.ledgers.items()},
                                     {c: list(led.events) for c, led in self.budget_ledgers.items()})
        self._file.append(entries)
        logger.info("privacy ledger %s: migrated %d checkpoint entries", self.ledger_path, len(entries))
