"""RC-DPFL comparison harness (``python -m fedfdp.experiments rcdpfl-table``): the paper's Tables 3–10 layout.

Methods × ε × seeds, each one subprocess ``python -m fedfdp.fit --config <generated> --run_dir
<out>/runs/<dataset>_<method>_eps<ε>_s<seed>`` launched by
:class:`fedfdp.experiments.runner.Runner` (finished runs are skipped, interrupted ones resumed; a
failed run is reported and the others go on). The generated config,
``<out>/configs/<dataset>_<method>_eps<ε>_s<seed>.yaml``, is ``configs/rcdpfl/<dataset>_<method>.yaml``
with the seed, the round count and ``RDPAccounting.target_epsilon`` set (a config without an
accountant is a non-private reference, ``local_nodp``: run once per seed as
``<dataset>_<method>_s<seed>``, whatever ``--epsilons``); the clustered algorithms
calibrate z_i for that target themselves (two-stage for RC-DPFL), and DP-FedAvg gets here the
smallest z whose whole-run schedule (the algorithm's own per-round events,
``FedAvg.planned_dp_events`` with its ``privacy``, over the run's rounds) meets the target
(:func:`fedfdp.privacy.schedule.calibrate_noise_multiplier`). Columns (spec §5, in %):
All / Maj / Min mean test accuracy, worst client, max−min disparity, F_acc / F_loss (privacy-cost
spread against the non-private per-cluster reference models), clustering accuracy of the final
assignment and of RC-DPFL's round-1 GMM, spent ε. ``majority`` is no run: each client predicts the
most frequent label of its training split (computed on the split of ``<dataset>_local.yaml``), the
label-only floor every method must beat. Writes ``results.csv`` (one row per run) and ``table.md``
(mean ± population std over seeds; the non-private rows under ε "no DP") into ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedfdp import strict_yaml
from fedfdp.errors import ConfigError
from fedfdp.experiments._common import add_dry_run, add_list_option, message, output
from fedfdp.experiments.results import finished_summary, format_mean_std, group_rows
from fedfdp.experiments.runner import Runner, RunSpec
from fedfdp.privacy.accounting import PAPER_ORDERS, DPEvent
from fedfdp.privacy.schedule import calibrate_noise_multiplier

LABELS = {"dpfedavg": "DPFedAvg", "ifca": "IFCA (f-CDPFL)",
          "ifca_seed": "IFCA (seed selection, unaccounted)", "kmcdpfl": "KM-CDPFL", "rcdpfl": "RC-DPFL",
          "rcdpfl_seed": "RC-DPFL (seed selection, unaccounted)", "oracle": "Oracle (O-CDPFL)", "local": "Local",
          "local_nodp": "Local, no DP", "majority": "Majority label"}
MAJORITY = "majority"  # computed from the split, not trained
COLUMNS = [("acc_all", "All"), ("acc_majority", "Maj"), ("acc_minority", "Min"), ("acc_min", "MinAcc"),
           ("acc_disparity", "Disp"), ("f_acc", "F_acc"), ("f_loss", "F_loss"),
           ("clustering_accuracy", "clust. acc"), ("gmm_clustering_accuracy", "GMM acc"), ("epsilon", "ε spent")]
PERCENT = {"acc_all", "acc_majority", "acc_minority", "acc_min", "acc_disparity", "f_acc"}


def register(subparsers: Any) -> None:
    """Add the ``rcdpfl-table`` command."""
    p = subparsers.add_parser("rcdpfl-table", help="RC-DPFL vs DPFedAvg / IFCA / KM-CDPFL / oracle / local")
    p.add_argument("--dataset", default="digits", help="config prefix under configs/rcdpfl: digits, mnist, fmnist")
    add_list_option(p, "--methods", default=["dpfedavg", "ifca", "kmcdpfl", "rcdpfl", "oracle"],
                    help="methods, of " + " ".join(LABELS))
    add_list_option(p, "--epsilons", item_type=float, default=[5.0], help="target ε values")
    add_list_option(p, "--seeds", item_type=int, default=[0, 1], help="seeds")
    p.add_argument("--rounds", type=int, default=None, help="override model.num_rounds (default: the config's)")
    p.add_argument("--out", default=None, help="output folder (default runs/rcdpfl-table/<dataset>)")
    p.add_argument("--nice", type=int, default=15, help="niceness of the runs (0: none)")
    p.add_argument("--override", action="append", default=[], help="extra fit argument (repeatable, e.g. "
                   "--override=--data.init_args.train_per_client=100)")
    add_dry_run(p)
    p.set_defaults(func=run)


def _callback(config: dict[str, Any], name: str) -> dict[str, Any]:
    for cb in config["trainer"]["callbacks"]:
        if cb["class_path"].endswith(name):
            return cb.setdefault("init_args", {})
    raise KeyError(name)


def _algorithm(class_path: str, init_args: dict[str, Any]) -> Any:
    """The algorithm of a config node (its ``privacy`` node instantiated too)."""
    module, _, name = class_path.rpartition(".")
    args = dict(init_args)
    if isinstance(args.get("privacy"), dict):
        args["privacy"] = _algorithm(args["privacy"]["class_path"], args["privacy"].get("init_args") or {})
    return getattr(importlib.import_module(module), name)(**args)


def _with_noise(algorithm: dict[str, Any], z: float) -> dict[str, Any]:
    """``init_args`` of a private algorithm node with its mechanism's σ set to ``z``."""
    privacy = algorithm["init_args"]["privacy"]
    return {**algorithm["init_args"], "privacy": {**privacy, "init_args": {**(privacy.get("init_args") or {}),
                                                                             "noise_multiplier": z}}}


def one_stage_noise_multiplier(algorithm: dict[str, Any], *, rounds: int, epsilon: float, delta: float,
                               orders: Sequence[float] = PAPER_ORDERS) -> float:
    """The smallest z with which ``rounds`` rounds of the algorithm (a config's ``class_path`` and
    ``init_args``) spend at most ``epsilon``: its whole-run schedule is its own per-round events
    (``planned_dp_events``, as the accountant charges them) repeated ``rounds`` times."""

    def schedule(z: float) -> list[DPEvent]:
        per_round = _algorithm(algorithm["class_path"], _with_noise(algorithm, z))
        return [event.repeated(rounds) for _, event in per_round.planned_dp_events(client_id=0, dataset_size=1)]

    return calibrate_noise_multiplier(schedule, target_epsilon=epsilon, delta=delta, orders=orders)


def is_private(config: dict[str, Any]) -> bool:
    """Whether a config charges an accountant (``callbacks.RDPAccounting``); one without is a
    non-private reference (no ε)."""
    return any(str(cb.get("class_path", "")).endswith("RDPAccounting")
               for cb in (config.get("trainer") or {}).get("callbacks") or [])


def make_config(base: Path, *, seed: int, epsilon: float | None, rounds: int | None) -> dict[str, Any]:
    """The base config with the seed, rounds and target ε set (and DP-FedAvg's one-stage z); a
    non-private config (:func:`is_private`) gets only the seed and rounds (``epsilon`` None)."""
    config = strict_yaml.load(base.read_text())
    config["seed_everything"] = seed
    if rounds is not None:
        config["model"]["num_rounds"] = rounds
    if not is_private(config):
        return config
    accounting = _callback(config, "RDPAccounting")
    accounting["target_epsilon"] = epsilon
    algorithm = config["model"]["algorithm"]
    if algorithm["class_path"].endswith(".FedAvg") and "privacy" in algorithm.get("init_args", {}):
        from fedfdp.privacy.run_accountant import RunAccountant  # the run's accountant: its δ and RDP orders

        accountant = RunAccountant(**accounting)
        algorithm["init_args"] = _with_noise(algorithm, one_stage_noise_multiplier(
            algorithm, rounds=int(config["model"]["num_rounds"]), epsilon=epsilon, delta=accountant.delta,
            orders=accountant.orders))
    return config


def run_spec(out: Path, name: str, overrides: Sequence[str],
             make: Callable[[], dict[str, Any]] | None = None) -> RunSpec:
    """The run ``name``: ``<out>/runs/<name>``, its config ``<out>/configs/<name>.yaml`` (written by ``make``)."""
    return RunSpec(run_dir=out / "runs" / name, config=out / "configs" / f"{name}.yaml",
                   args=("--wandb", "disabled", *overrides), make_config=make)


def runner(niceness: int) -> Runner:
    """The runner of the table: W&B disabled, one OpenMP thread unless the environment says otherwise."""
    return Runner(env={"WANDB_MODE": "disabled"}, env_defaults={"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"},
                  niceness=niceness)


def _row(summary: dict[str, Any]) -> dict[str, Any]:
    final = summary["final"]
    row = {key: final.get(key, float("nan")) for key, _ in COLUMNS if key != "epsilon"}
    row.update(epsilon=summary.get("epsilon"), target_epsilon=summary.get("target_epsilon"),
               dp_valid=summary.get("dp_valid"), rounds=summary["rounds_run"],
               seconds_per_round=summary.get("seconds_per_round"))
    return row


def _cell(values: list[float], key: str) -> str:
    """Mean ± population std of the finite values (in % for the accuracy columns); ``–`` for none."""
    scale, digits = (100.0, 1) if key in PERCENT else (1.0, 2)
    return format_mean_std([float(v) for v in values if v is not None and math.isfinite(v)],
                           lambda v: f"{scale * v:.{digits}f}", ddof=0, empty="–")


def majority_row(config: Path) -> dict[str, Any]:
    """The majority-label row: each client predicts its training split's most frequent label
    (:func:`fedfdp.experiments.baselines.majority_label_baseline` on ``config``'s split), scored on
    its test split, with the clustered table's group accuracies; nothing is trained or released."""
    from callbacks.cluster_metrics import group_accuracies
    from fedfdp.experiments.baselines import datamodule_from_config, majority_label_baseline

    datamodule = datamodule_from_config(config, labels_only=True)
    accuracy = majority_label_baseline(datamodule)["client_accuracy"]
    groups = group_accuracies(accuracy, np.asarray(datamodule.client_cluster),
                              list(getattr(datamodule, "minority_clusters", [])))
    return {"method": MAJORITY, "target": None, "seed": None, **groups, "epsilon": None}


def write_table(rows: list[dict[str, Any]], out: Path) -> str:
    """``results.csv`` (per run) and ``table.md`` (mean ± std over seeds per ε and method)."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    with open(out / "results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| ε | method | " + " | ".join(label for _, label in COLUMNS) + " | seeds |",
             "|---|---|" + "---|" * (len(COLUMNS) + 1)]
    for (eps,), same_eps in group_rows(rows, "target").items():
        for (method,), group in group_rows(same_eps, "method").items():
            cells = [_cell([r.get(k) for r in group], k) for k, _ in COLUMNS]
            seeds = "–" if method == MAJORITY else str(len(group))
            lines.append(f"| {'no DP' if eps is None else format(eps, 'g')} | {LABELS.get(method, method)} | "
                         + " | ".join(cells) + f" | {seeds} |")
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    return table


def run(args: argparse.Namespace) -> int:
    """Run every (ε, method, seed) (a non-private method once per seed) and write the table."""
    out = Path(args.out or f"runs/rcdpfl-table/{args.dataset}")
    methods = list(args.methods)
    # the majority label reads the split of the dataset's local config
    bases = {method: Path("configs/rcdpfl") / f"{args.dataset}_{'local' if method == MAJORITY else method}.yaml"
             for method in methods}
    for method, base in bases.items():
        if not base.exists():
            message(f"error: rcdpfl-table: no config {base} (--dataset {args.dataset}, --methods {method}; "
                    f"methods: {' '.join(LABELS)})")
            return 2
    private = {m: is_private(strict_yaml.load(base.read_text())) for m, base in bases.items() if m != MAJORITY}
    jobs = [(f"{args.dataset}_{m}_eps{eps:g}_s{seed}", m, eps, seed)
            for eps in args.epsilons for m in methods if private.get(m) for seed in args.seeds]
    jobs += [(f"{args.dataset}_{m}_s{seed}", m, None, seed)
             for m in methods if private.get(m) is False for seed in args.seeds]
    launcher = runner(args.nice)
    rows: list[dict[str, Any]] = []
    failed = 0
    dry: list[RunSpec] = []
    for name, method, eps, seed in jobs:
        # the dry run checks a finished run against the config it would make, like the run itself (the
        # staged <out>/configs/<name>.yaml exists only once a run was launched from this tree)
        spec = run_spec(out, name, args.override, lambda base=bases[method], seed=seed, eps=eps: make_config(
            base, seed=seed, epsilon=eps, rounds=args.rounds))
        if args.dry_run:
            dry.append(spec)
            continue
        try:
            result = launcher.run(spec)
        except ConfigError as err:
            message(f"error: rcdpfl-table: {name}: {err}")
            return 2
        summary = finished_summary(spec.run_dir)  # only complete runs are tabulated
        # keep going: one failed (or incomplete) run must not lose the others
        if result.status in ("failed", "incomplete") or summary is None:
            message(f"error: {name} failed (exit {result.returncode}): {result.error_line} "
                    f"(see {result.log})")
            failed += 1
            continue
        wall = result.wall_seconds
        rows.append({"method": method, "target": eps, "seed": seed, **_row(summary), "wall_seconds": wall})
        spent = rows[-1]["epsilon"]
        output(f"{name}: All {100 * rows[-1]['acc_all']:.1f} Min {100 * rows[-1]['acc_minority']:.1f} "
               f"eps {'none (no DP)' if spent is None else f'{spent:.3f}'} ({wall:.0f} s)")
        if eps is not None and (spent is None or spent > eps + 1e-9):
            message(f"error: {name} spent epsilon {spent} > target {eps}" if spent is not None else
                    f"error: {name} has no spent epsilon although its config has an accountant (target {eps})")
            return 1
    if args.dry_run:
        return launcher.dry_run(dry)
    if MAJORITY in methods:
        rows.append(majority_row(bases[MAJORITY]))
    if rows:
        output(write_table(rows, out))
    return 1 if failed else 0
