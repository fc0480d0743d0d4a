"""Run outputs: ``summary.json`` in the run directory and a per-client table in W&B."""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch import LightningModule, Trainer

from callbacks.base import FederationCallback
from fedfdp.errors import DivergenceError
from fedfdp.participation import MISSING_CLIENTS_STATUSES, final_status
from fedfdp.rundir import RunPaths

if TYPE_CHECKING:
    from fedfdp.federation import Federation
    from fedfdp.metrics import EvaluationResult

logger = logging.getLogger(__name__)


def peak_memory_mb() -> float:
    """Peak resident memory of this process (MB)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON through a temporary file and ``os.replace`` so a crash never leaves half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True))
        os.replace(tmp, path)
    except OSError as err:  # a full disk, a read-only folder: leave the last complete file, no half-written one
        tmp.unlink(missing_ok=True)
        if err.filename is None:
            err.filename = str(tmp)
        raise


#: ``summary.json``'s ``status``: how the run stands or ended. ``completed_with_missing_clients`` and
#: ``budget_spent_with_missing_clients``: every planned round ran, but some sampled client did not
#: upload in some round, or the final evaluation does not cover every client (a deployment's lost
#: or refusing nodes; :mod:`fedfdp.participation`).
STATUSES = ("running", "completed", "budget_spent", *MISSING_CLIENTS_STATUSES, "diverged", "interrupted", "failed")


def evaluated_clients(result: EvaluationResult | None) -> list[int] | None:
    """The clients an evaluation has numbers for (not NaN); None before the first evaluation."""
    if result is None:
        return None
    return [cid for cid, acc in enumerate(result.client_accuracy.tolist()) if acc == acc]


def left_out_clients(federation: Federation) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """``({client: rounds left out}, {client: rounds refused})`` of the run (empty in a simulation)."""
    participation = getattr(federation, "participation", None)
    if participation is None:
        return {}, {}
    return participation.left_out(), participation.left_out("refused")


def privacy_claims(trainer: Trainer, federation: Federation) -> dict[str, Any]:
    """``dp_valid`` and ``evaluated_models_private`` of a run, fail-closed.

    ``dp_valid``: the run has an accountant that checked, at start, that every release is noised
    and bounded and every field of the uploads is declared private
    (:mod:`fedfdp.privacy.uploads`), and none ran without a guarantee (``allow_non_private``).
    ``evaluated_models_private``: moreover every model the run evaluates and reports is covered
    by that ε (``Algorithm.covers_evaluated_models``, fail-closed; false e.g. for DP-Ditto's
    personal models trained by plain SGD on the client). With them, the unit ε is for
    (:func:`privacy_unit`).
    """
    accountant = federation.accountant
    dp_valid = accountant is not None and accountant.guarantee_holds
    covered = federation.algorithm.covers_evaluated_models()
    return {"dp_valid": dp_valid, "evaluated_models_private": dp_valid and covered, **privacy_unit(federation)}


def privacy_unit(federation: Federation) -> dict[str, str | None]:
    """``epsilon_unit`` (what one ε hides; None without an accountant) and ``privacy_mechanism`` (the
    algorithm's mechanism in words). ``record``: ε is for one record of any one client, the largest
    over the clients' ledgers (DP-SGD steps, loss, count and histogram releases); ``client``: a
    client-level mechanism runs and ε is for a whole client of the population (its ledger)."""
    mechanism = getattr(federation.algorithm, "privacy", None)
    accountant = federation.accountant
    return {"epsilon_unit": accountant.unit if accountant is not None else None,
            "privacy_mechanism": mechanism.describe() if mechanism is not None else None}


def privacy_guarantees(federation: Federation) -> dict[str, dict[str, Any]] | None:
    """``privacy``: the (ε, δ) of each unit the run protects, for whom and for which models
    (``models_covered`` in words; ``models`` as every privacy-ledger event names them,
    :meth:`fedfdp.algorithms.Algorithm.covered_models`).

    ``record`` always (one record of any client); ``client`` when a client-level mechanism runs (one
    client of the population of N, with its noise multiplier, sampling rate and charged rounds).
    With a client-level mechanism the record ε is the better of the two valid analyses (a client's
    change covers any change of one of its records). None without an accountant.
    """
    accountant = federation.accountant
    if accountant is None:
        return None
    covered = federation.algorithm.covers_evaluated_models()
    models = ("every model the run evaluates and reports" if covered
              else "the released global models only (not the models kept and evaluated on the clients)")
    out: dict[str, dict[str, Any]] = {"record": {
        "epsilon": accountant.record_epsilon(), "delta": accountant.delta,
        "population": f"the records of the {federation.num_clients} clients", "models_covered": models,
        "models": federation.algorithm.covered_models()}}
    mechanism = federation.privacy_mechanism
    if accountant.unit == "client" and mechanism is not None:
        implied = accountant.record_epsilon() == accountant.epsilon()
        out["record"]["analysis"] = ("implied by the client-level guarantee (a client's change covers any change of "
                                     "one of its records)" if implied else
                                     "the record-level releases of each client (DP-SGD), the better of the two")
        out["client"] = {
            "epsilon": accountant.epsilon(), "delta": accountant.delta,
            "noise_multiplier": float(getattr(mechanism, "noise_multiplier")),
            "sampling_rate": float(getattr(mechanism, "sample_rate")(federation.num_clients)),
            "rounds": accountant.population_rounds(), "population": federation.num_clients,
            "models_covered": models, "models": federation.algorithm.covered_models()}
    return out


class RunSummary(FederationCallback):
    """Writes ``summary.json`` after every evaluation and when the run ends, however it ends.

    Contents: ``status`` (``running`` while the run goes on; ``completed`` after ``num_rounds``,
    ``budget_spent`` when the privacy budget set the rounds, either with ``_with_missing_clients``
    when a client was left out of a round or of the final evaluation, ``diverged``,
    ``interrupted`` by a signal, ``failed`` on any other error), rounds run, the latest evaluation
    (pooled accuracy, per-client accuracy and loss, Ψ variants, accuracy dispersion) and its round,
    ``evaluated_clients`` (the clients those figures cover; each history entry that covers fewer
    than all clients lists its own), ``missing_clients`` (``{client: [1-based rounds]}`` in which a
    sampled client did not upload; ``refused_clients`` the subset it refused on its own budget),
    the best pooled accuracy, the privacy claims (:func:`privacy_claims`), ε spent (and budgeted ε),
    the seed, seconds per round, peak memory and ``wall_seconds``.

    A resumed run's summary covers the whole run: the history, best accuracy and round times come
    with the checkpoint, and ``wall_seconds`` is this session's wall time (since this callback was
    built: with the command line, since the run was set up, data loading included) plus that of
    the earlier sessions as of their last summary or checkpoint (what a killed session spent after
    it is not known).

    Args:
        dirpath: where to write (default: the trainer's ``default_root_dir``, i.e. the run directory).
        report: also write ``report.md`` with PNG plots at the end of the run (:mod:`fedfdp.report`).
    """

    def __init__(self, dirpath: str | None = None, report: bool = True) -> None:
        self.dirpath = dirpath
        self.report = report
        self.best_accuracy: float | None = None
        self.best_round: int | None = None
        self.history: list[dict[str, float]] = []
        self._earlier_wall = 0.0  # wall seconds of earlier sessions of the run
        self._earlier_rounds = (0.0, 0)  # (seconds, rounds) timed by earlier sessions
        self._session_rounds = (0.0, 0)  # (seconds, rounds) timed by this session
        self._session_start = time.monotonic()  # this session: from building the run (data loading included)
        self._last_result: EvaluationResult | None = None
        self._training = False  # training started: a summary is owed however the run ends
        self.last_status: str | None = None  # the status last written (``final_status`` of the one asked)

    def _path(self, trainer: Trainer) -> Path:
        path = Path(self.dirpath or trainer.default_root_dir)
        path.mkdir(parents=True, exist_ok=True)
        return RunPaths(path).summary

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """On a resume, tell the federation whether the run directory's summary says the run never ended
        (``running``: cut by SIGKILL or a power loss; ``interrupted``): a checkpoint at the run's last round
        then finishes the run instead of being refused (``Federation.unfinished_run``)."""
        if trainer.ckpt_path is None:
            return
        try:
            status = json.loads(RunPaths(self.dirpath or trainer.default_root_dir).summary.read_text()).get("status")
        except (OSError, ValueError, AttributeError):
            return
        pl_module.unfinished_run = status in ("running", "interrupted")  # type: ignore[assignment]

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A resume that only finished a run cut after its last round writes the run's end here (no round
        ran, so :meth:`on_train_end` was not called)."""
        if getattr(pl_module, "finishing", False):
            self._training = True
            self.on_train_end(trainer, pl_module)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """On a resume, count the wall time of the earlier sessions as their last summary has it."""
        self._training = True
        if trainer.ckpt_path is None:
            return
        path = RunPaths(self.dirpath or trainer.default_root_dir).summary
        try:
            earlier = float(json.loads(path.read_text()).get("wall_seconds") or 0.0)
        except (OSError, ValueError, TypeError, AttributeError):
            return
        self._earlier_wall = max(self._earlier_wall, earlier)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Note this session's round times (for :meth:`state_dict`, which checkpoints save)."""
        seconds = getattr(pl_module, "round_seconds", None) or []
        self._session_rounds = (float(sum(seconds)), len(seconds))

    def wall_seconds(self) -> float:
        """Wall time of the whole run: the earlier sessions' plus this one's so far."""
        return self._earlier_wall + (time.monotonic() - self._session_start)

    def _round_seconds(self) -> tuple[float, int]:
        return self._earlier_rounds[0] + self._session_rounds[0], self._earlier_rounds[1] + self._session_rounds[1]

    def on_evaluate(self, trainer: Trainer, federation: Federation, result: EvaluationResult,
                    metrics: dict[str, Any]) -> None:
        """Record the evaluation and rewrite the summary."""
        acc = result.scalars["accuracy"]
        if self.best_accuracy is None or acc > self.best_accuracy:
            self.best_accuracy, self.best_round = acc, result.round
        entry: dict[str, Any] = {"round": result.round, **result.scalars}
        covered = evaluated_clients(result)
        if covered is not None and len(covered) < federation.num_clients:
            entry["evaluated_clients"] = covered
        if self.history and self.history[-1]["round"] == result.round:  # a finishing resume evaluates it again
            self.history[-1] = entry
        else:
            self.history.append(entry)
        self._last_result = result
        self.write(trainer, federation, "running")

    def write(self, trainer: Trainer, federation: Federation, status: str) -> Path | None:
        """Write ``summary.json`` with ``status`` and the latest evaluation (rank zero only); also into
        the W&B run's summary. Returns the path written (None on other ranks)."""
        if not trainer.is_global_zero:  # several processes hold the same results; one writes them
            return None
        summary = self.summary(trainer, federation, self._last_result, status)
        self.last_status = summary["status"]
        path = self._path(trainer)
        write_json_atomic(path, summary)
        _to_wandb_summary(trainer, summary)
        return path

    def summary(self, trainer: Trainer, federation: Federation, result: EvaluationResult | None,
                status: str = "running") -> dict[str, Any]:
        """The summary dictionary for the latest evaluation (``result``; None before the first)."""
        assert status in STATUSES, status
        accountant = federation.accountant
        seconds = federation.round_seconds
        self._session_rounds = (float(sum(seconds)), len(seconds))
        total, timed = self._round_seconds()
        left_out, refused = left_out_clients(federation)
        evaluated = evaluated_clients(result)
        out: dict[str, Any] = {
            "status": final_status(status, left_out, evaluated, federation.num_clients),
            "rounds_run": int(trainer.global_step),
            "rounds_planned": federation.total_rounds,
            "final_evaluation_round": result.round if result is not None else None,
            "algorithm": type(federation.algorithm).__name__,
            "num_clients": federation.num_clients,
            "final": dict(result.scalars) if result is not None else None,
            "evaluated_clients": evaluated,
            "missing_clients": {str(c): rounds for c, rounds in left_out.items()},
            "refused_clients": {str(c): rounds for c, rounds in refused.items()},
            "best_accuracy": self.best_accuracy,
            "best_accuracy_round": self.best_round,
            "clients": None if result is None else {
                "accuracy": result.client_accuracy.tolist(), "loss": result.client_loss.tolist(),
                "train_size": [int(w) for w in result.weights.tolist()]},
            "seed": federation.seed,
            "seconds_per_round": total / timed if timed else None,
            "wall_seconds": self.wall_seconds(),
            "peak_memory_mb": peak_memory_mb(),
            **privacy_claims(trainer, federation),
            "history": self.history,
        }
        if accountant is not None:
            out["epsilon"] = accountant.epsilon()
            out["epsilon_budgeted"] = accountant.budgeted_epsilon()
            out["delta"] = accountant.delta
            out["target_epsilon"] = accountant.target_epsilon
            out["accounting_mode"] = accountant.accounting_mode
            out["releases_repeated"] = accountant.repeated_releases  # charged twice: a session cut mid-round
            out["privacy"] = privacy_guarantees(federation)
        for cb in federation.federation_callbacks():
            out.update(cb.summary_entries(federation))
        return out

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Write the final summary (its status: completed, budget spent or interrupted), then the run
        report (plots need the CSV metrics, flushed by the loggers at the end)."""
        federation: Federation = pl_module  # type: ignore[assignment]
        if federation.stop_signal is not None or trainer.global_step < federation.total_rounds:
            status = "interrupted"
        else:
            status = "budget_spent" if federation.budget_limited else "completed"
        path = self.write(trainer, federation, status)
        if path is None:
            return
        if self.last_status != status:
            logger.warning("run %s, but with clients left out: status %s (summary.json: missing_clients, "
                           "evaluated_clients)", status, self.last_status)
        logger.info("summary written to %s (status %s)", path, self.last_status)
        if self.report:  # a run stopped before its first evaluation gets its training metrics and privacy
            from fedfdp.report import write_report

            for lg in trainer.loggers:
                lg.save()
            logger.info("report written to %s", write_report(path.parent))

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """A run stopped by an error says so: ``diverged`` (non-finite model or loss), ``interrupted``
        (a second signal), else ``failed``; written only once training has produced a summary."""
        if not self._training or not hasattr(pl_module, "total_rounds"):
            return  # the start was refused: leave no summary behind
        if isinstance(exception, DivergenceError):
            status = "diverged"
        elif isinstance(exception, KeyboardInterrupt):
            status = "interrupted"
        else:
            status = "failed"
        try:
            self.write(trainer, pl_module, status)  # type: ignore[arg-type]
        except OSError as err:  # the disk that stopped the run may refuse this write too: the error is reported
            logger.warning("summary.json could not be updated to status %s: %s", status, err)

    def state_dict(self) -> dict[str, Any]:
        """Best accuracy, evaluation history, wall and round times (so a resumed run's summary is complete)."""
        total, timed = self._round_seconds()
        return {"best_accuracy": self.best_accuracy, "best_round": self.best_round, "history": self.history,
                "wall_seconds": self.wall_seconds(), "round_seconds": [total, timed]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (checkpoints without wall or round times count them as 0)."""
        self.best_accuracy = state_dict["best_accuracy"]
        self.best_round = state_dict["best_round"]
        self.history = list(state_dict["history"])
        self._earlier_wall = float(state_dict.get("wall_seconds", 0.0))
        total, timed = state_dict.get("round_seconds", (0.0, 0))
        self._earlier_rounds = (float(total), int(timed))
        self._session_rounds = (0.0, 0)


def _to_wandb_summary(trainer: Trainer, summary: dict[str, Any]) -> None:
    """Put the run's status, privacy claims and ε into the W&B run summary (what W&B tables show)."""
    from lightning.pytorch.loggers import WandbLogger

    keys = ("status", "rounds_run", "dp_valid", "evaluated_models_private", "epsilon", "delta", "target_epsilon")
    for lg in trainer.loggers:
        if isinstance(lg, WandbLogger):
            lg.experiment.summary.update({k: summary[k] for k in keys if k in summary})


class ClientTableLogger(FederationCallback):
    """Logs a per-client table (size, accuracy, loss) and a bar chart of client accuracy to W&B."""

    def on_evaluate(self, trainer: Trainer, federation: Federation, result: EvaluationResult,
                    metrics: dict[str, Any]) -> None:
        """One W&B table row per client, plus ``wandb.plot.bar`` of the accuracies."""
        from lightning.pytorch.loggers import WandbLogger  # wandb is only needed when used

        loggers = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
        if not loggers:
            return
        import wandb

        columns = ["client", "train_size", "accuracy", "loss"]
        rows = [[cid, int(w), float(a), float(l)] for cid, (w, a, l) in
                enumerate(zip(result.weights.tolist(), result.client_accuracy.tolist(), result.client_loss.tolist()))]
        for lg in loggers:
            table = wandb.Table(columns=columns, data=rows)
            lg.experiment.log({"clients": table,
                               "client_accuracy": wandb.plot.bar(table, "client", "accuracy",
                                                                 title=f"Client accuracy, round {result.round}")},
                              step=trainer.global_step)
