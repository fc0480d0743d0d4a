"""Reproduction harness for the paper's tables II-VI (``python -m fedfdp.experiments paper-table4``).

Each run is one subprocess ``python -m fedfdp.fit --config <derived yaml> --run_dir
<out>/<table>/<column>/<method>/seed<k> --seed_everything k``. The derived YAML is the method's
``configs/<dataset>_<method>.yaml`` with the column's overrides (Dirichlet β, number of clients,
ε, σ) and an optional ``--rounds`` cap applied. The runs are launched by
:class:`fedfdp.experiments.runner.Runner`: finished runs are skipped, interrupted ones resume
from ``checkpoints/last.ckpt``. The summaries are then aggregated into a markdown table in the
paper's layout (method rows; per column accuracy and Ψ = ``psi_paper``, mean ± sample std over
seeds), a long-format CSV and a PNG.
"""

from __future__ import annotations

import argparse
import csv
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedfdp import strict_yaml
from fedfdp.experiments._common import add_dry_run, add_list_option, message, output, print_command
from fedfdp.experiments.results import (
    ended_with_missing_clients, finished_summary, format_mean_std, group_rows, is_finished, mean_std, read_summary,
    recorded_wall_seconds,
)
from fedfdp.experiments.runner import RunSpec, Runner

logger = logging.getLogger(__name__)

DATASETS = {"mnist": "MNIST", "fmnist": "FMNIST", "cifar10": "CIFAR10"}
NON_PRIVATE = [("FedAvg", "fedavg"), ("SCAFFOLD", "scaffold"), ("FedProx", "fedprox"), ("FedDyn", "feddyn"),
               ("q-FFL", "qffl"), ("FedFair", "fedfair")]
PRIVATE = [("FedAvg", "dpfedavg"), ("SCAFFOLD", "scaffold_dp"), ("FedProx", "fedprox_dp"), ("FedDyn", "feddyn_dp"),
           ("ALI-DPFL", "alidpfl"), ("q-FFL", "qffl_dp"), ("FedFDP", "fedfdp"),
           # each client alone with DP-SGD at the column's ε, σ and split (its own lr, tuned at ε 3.52,
           # Dir(0.1)): the baseline every private table carries (configs/<dataset>_local_dp.yaml)
           ("Local DP-SGD", "local_dp")]
#: each client alone without DP (configs/<dataset>_local.yaml): the non-private bound of what training
#: alone gives, a row of the private tables whose columns change the data (IV: the dataset, V: β and the
#: client count); Table VI's columns change only ε, so its row is Table IV's Dir(0.1) one
LOCAL_NO_DP = [("Local, no DP", "local")]
ACCOUNTANT = "callbacks.RDPAccounting"


@dataclass(frozen=True)
class Column:
    """One column group of a table: a dataset and config overrides (dotted keys)."""

    label: str
    dataset: str
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def slug(self) -> str:
        return self.label.lower().replace(" ", "").replace("(", "").replace(")", "").replace("=", "").replace(".", "p")


def _per_dataset(datasets: Sequence[str]) -> list[Column]:
    return [Column(DATASETS[d], d) for d in datasets]


def _heterogeneity(datasets: Sequence[str]) -> list[Column]:
    cols = []
    for d in datasets:
        cols += [Column(f"{DATASETS[d]} Dir({b})", d, {"data.init_args.alpha": b}) for b in (0.1, 0.5, 1.0)]
        cols += [Column(f"{DATASETS[d]} {n} cl.", d, {"data.init_args.num_clients": n}) for n in (20, 50)]
    return cols


def _epsilons(datasets: Sequence[str]) -> list[Column]:
    cols = []
    for d in datasets:
        for eps, sigma in ((1, 2.0), (2, 2.0), (3, 2.0), (4, 1.65)):
            cols.append(Column(f"{DATASETS[d]} eps={eps}", d, {f"callback:{ACCOUNTANT}.target_epsilon": float(eps),
                                                               "model.algorithm.init_args.privacy.init_args.noise_multiplier": sigma}))
    return cols


@dataclass(frozen=True)
class Table:
    """A paper table: method rows and column groups."""

    title: str
    methods: list[tuple[str, str]]
    columns: Callable[[Sequence[str]], list[Column]]
    default_datasets: tuple[str, ...] = ("mnist", "fmnist", "cifar10")


TABLES = {
    "table2": Table("Table II: non-private, Dir(0.1), 10 clients", NON_PRIVATE, _per_dataset),
    "table3": Table("Table III: non-private, heterogeneity and scalability", NON_PRIVATE, _heterogeneity),
    "table4": Table("Table IV: DP, eps = 3.52, delta = 1e-5, Dir(0.1), 10 clients", PRIVATE + LOCAL_NO_DP,
                    _per_dataset),
    "table5": Table("Table V: DP (eps = 3.52), heterogeneity and scalability", PRIVATE + LOCAL_NO_DP,
                    _heterogeneity),
    "table6": Table("Table VI: DP, varying eps (sigma = 2, 1.65 for eps = 4)", PRIVATE, _epsilons, ("fmnist",)),
}


def config_path(config_dir: Path, dataset: str, stem: str) -> Path:
    """``configs/<dataset>_<stem>.yaml`` (FedFDP on FashionMNIST is ``configs/fmnist.yaml``)."""
    path = config_dir / f"{dataset}_{stem}.yaml"
    return path if path.exists() or stem != "fedfdp" else config_dir / f"{dataset}.yaml"


def _node(config: dict[str, Any], path: list[str]) -> dict[str, Any]:
    """The dictionary at ``path`` in ``config`` (empty where it is missing)."""
    node: Any = config
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}


def apply_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys; ``callback:<class_path>.<arg>`` sets an init arg of that trainer callback."""
    for key, value in overrides.items():
        if key.startswith("callback:"):
            class_path, arg = key[len("callback:"):].rsplit(".", 1)
            matches = [cb for cb in config.get("trainer", {}).get("callbacks", []) if cb["class_path"] == class_path]
            for cb in matches:
                cb.setdefault("init_args", {})[arg] = value
            continue
        mechanism, _, _ = key.partition(".privacy.")
        if key != mechanism and not isinstance(_node(config, mechanism.split(".")).get("privacy"), dict):
            continue  # a non-private method: the mechanism's options (σ) do not apply
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return config


@dataclass
class Run:
    """One (method, column, seed) run."""

    table: str
    method: str
    stem: str
    column: Column
    seed: int
    config: Path
    run_dir: Path

    def summary(self) -> dict[str, Any] | None:
        return read_summary(self.run_dir)

    @property
    def done(self) -> bool:
        return is_finished(self.summary())

    def spec(self, rounds: int | None, extra: Sequence[str]) -> RunSpec:
        """The runner's spec: ``<run_dir>/input_config.yaml`` is the method's config with the column's
        overrides (and the ``rounds`` cap), written when the run starts."""

        def derived() -> dict[str, Any]:
            overrides = dict(self.column.overrides)
            if rounds is not None:
                overrides["model.num_rounds"] = rounds
            return apply_overrides(strict_yaml.load(self.config.read_text()), overrides)

        return RunSpec(run_dir=self.run_dir, config=self.run_dir / "input_config.yaml", seed=self.seed,
                       args=("--trainer.enable_progress_bar", "false", "--wandb", "disabled", *extra),
                       make_config=derived)


def plan_runs(table: str, datasets: Sequence[str], seeds: Sequence[int], out: Path, config_dir: Path,
              methods: Sequence[str] | None = None, columns: Sequence[str] | None = None) -> list[Run]:
    """Every run of ``table`` on ``datasets`` and ``seeds`` (optionally only some methods, and only
    the columns whose label contains one of ``columns``, e.g. ``Dir(0.5)``)."""
    spec = TABLES[table]
    runs = []
    chosen = spec.methods if not methods else [m for name in methods for m in spec.methods if name in m]
    for column in spec.columns(datasets):
        if columns and not any(part in column.label for part in columns):
            continue
        for label, stem in chosen:  # in the order asked for (run order); tables keep the paper's order
            for seed in seeds:
                runs.append(Run(table, label, stem, column, seed, config_path(config_dir, column.dataset, stem),
                                out / table / column.slug / stem / f"seed{seed}"))
    return runs


def runner(niceness: int = 0) -> Runner:
    """The runner of the paper tables (W&B disabled)."""
    return Runner(env={"WANDB_MODE": "disabled"}, niceness=niceness)


def fit_command(run: Run, extra: Sequence[str], niceness: int = 0) -> list[str]:
    """The ``fedfdp.fit`` command of one run; its config is ``<run_dir>/input_config.yaml`` (see :meth:`Run.spec`)."""
    return runner(niceness).command(run.spec(None, extra))


def execute(run: Run, rounds: int | None, niceness: int, extra: Sequence[str]) -> tuple[Run, int, float]:
    """Run (or resume) one fit; returns its exit status and wall time.

    A run that finished after the harness planned it (another harness on the same ``--out``
    finished it meanwhile) is left as it is, with the wall time it recorded.
    """
    result = runner(niceness).run(run.spec(rounds, extra))
    if result.status == "skipped":
        return run, 0, recorded_wall_seconds(run.run_dir) or 0.0
    return run, result.returncode, result.wall_seconds


def collect(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """One row per finished run (final pooled accuracy in %, Ψ = psi_paper of the global model)."""
    rows = []
    for run in runs:
        s = finished_summary(run.run_dir)
        if s is None:
            continue
        wall = recorded_wall_seconds(run.run_dir)
        rows.append({"table": run.table, "column": run.column.label, "dataset": run.column.dataset,
                     "method": run.method, "seed": run.seed, "accuracy": 100.0 * s["final"]["accuracy"],
                     "best_accuracy": 100.0 * s["best_accuracy"], "psi": s["final"]["psi"],
                     "accuracy_worst": 100.0 * s["final"].get("accuracy_worst", float("nan")),
                     "epsilon": s.get("epsilon"), "rounds_run": s["rounds_run"],
                     "seconds_per_round": s.get("seconds_per_round"), "wall_seconds": wall})
    return rows


def _fmt(values: Sequence[float], sci: bool) -> str:
    """Mean ± sample std over seeds: ``1.2e-02±3.0e-03`` (``sci``) or ``85.00±7.07``; ``—`` for none."""
    return format_mean_std(values, (lambda v: f"{v:.1e}") if sci else (lambda v: f"{v:.2f}"))


def markdown_table(title: str, methods: Sequence[str], columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    """Paper layout: one row per method; per column ``Acc (%)`` and ``Ψ`` as mean ± std over seeds."""
    groups = group_rows(rows, "method", "column")
    head = "| Method | " + " | ".join(f"{c} Acc (%) | {c} Ψ" for c in columns) + " |"
    lines = [f"### {title}", "", head, "|---|" + "---|---|" * len(columns)]
    for method in methods:
        cells = []
        for col in columns:
            sel = groups.get((method, col), [])
            cells += [_fmt([r["accuracy"] for r in sel], False), _fmt([r["psi"] for r in sel], True)]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", "| Method | Column | seeds | rounds | ε spent | best Acc (%) | worst-client Acc (%) | s/round |",
              "|---|---|---|---|---|---|---|---|"]
    for method in methods:
        for col in columns:
            sel = groups.get((method, col), [])
            if not sel:
                continue
            eps = [r["epsilon"] for r in sel if r["epsilon"] is not None]
            spr = [r["seconds_per_round"] for r in sel if r["seconds_per_round"] is not None]
            lines.append(f"| {method} | {col} | {len(sel)} | {sorted({r['rounds_run'] for r in sel})} | "
                         f"{(f'{max(eps):.3f}' if eps else '—')} | {_fmt([r['best_accuracy'] for r in sel], False)} | "
                         f"{_fmt([r['accuracy_worst'] for r in sel], False)} | "
                         f"{(f'{np.mean(spr):.2f}' if spr else '—')} |")
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, table: str, title: str, methods: Sequence[str], columns: Sequence[str],
                  rows: Sequence[dict[str, Any]]) -> dict[str, Path]:
    """``<table>.md``, ``<table>.csv`` and ``<table>.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / f"{table}.md", "csv": out / f"{table}.csv", "png": out / f"{table}.png"}
    paths["md"].write_text(markdown_table(title, methods, columns, rows))
    fields = ["table", "column", "dataset", "method", "seed", "accuracy", "best_accuracy", "psi", "accuracy_worst",
              "epsilon", "rounds_run", "seconds_per_round", "wall_seconds"]
    with open(paths["csv"], "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    _plot(paths["png"], title, methods, columns, rows)
    return paths


def _plot(path: Path, title: str, methods: Sequence[str], columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = group_rows(rows, "method", "column")
    fig, axes = plt.subplots(2, len(columns), figsize=(max(3.2 * len(columns) + 1, 7.5), 6), squeeze=False)
    for j, col in enumerate(columns):
        for i, (key, label) in enumerate((("accuracy", "accuracy (%)"), ("psi", "Ψ (log)"))):
            stats = [mean_std([r[key] for r in groups.get((m, col), [])] or [np.nan]) for m in methods]
            ax = axes[i][j]
            ax.bar(range(len(methods)), [s[0] for s in stats], yerr=[s[1] for s in stats], color="tab:blue")
            ax.set_xticks(range(len(methods)), methods, rotation=60, fontsize=7)
            ax.set_ylabel(label)
            if key == "psi" and any(np.isfinite(m) and m > 0 for m, _ in stats):  # log scale needs a value > 0
                ax.set_yscale("log")
            else:
                ax.set_title(col, fontsize=9)
    fig.suptitle(title, fontsize=9, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_table(args: argparse.Namespace) -> int:
    """Plan, run (skipping finished runs) and aggregate one table."""
    spec = TABLES[args.table]
    datasets = args.dataset or list(spec.default_datasets)
    out = Path(args.out)
    runs = plan_runs(args.table, datasets, args.seeds, out, Path(args.config_dir), args.methods, args.columns)
    # a finished run whose saved config is not what its row asks for now (a config edited since, another
    # --rounds): neither run again nor tabulated (the runner's error line names the difference)
    other = [r for r in runs
             if r.done and runner(args.nice).other_configuration(r.spec(args.rounds, args.fit_args or []))]
    runs = [r for r in runs if r not in other]
    todo = [r for r in runs if not r.done]
    logger.info("%s: %d runs, %d finished, %d to run", args.table, len(runs), len(runs) - len(todo), len(todo))
    missing = sorted({str(r.config) for r in todo if not r.config.exists()})
    if missing and not args.aggregate_only:
        message(f"error: paper-{args.table}: no config {', '.join(missing)} (see --config-dir)")
        return 2
    if args.dry_run:  # the commands only: nothing is run or written
        for run in todo:
            if ended_with_missing_clients(run.summary()):  # the runner would not run it again
                message(f"error: {run.run_dir} ran every round with clients left out: not run again")
                continue
            print_command(fit_command(run, args.fit_args or [], args.nice))
        return 1 if other else 0
    failed = 0
    if not args.aggregate_only and todo:
        specs = [r.spec(args.rounds, args.fit_args or []) for r in todo]
        if args.sweep:  # each method's runs together, one batched pass per round (fedfdp.sweep)
            by_method: dict[str, list[RunSpec]] = {}
            for run, run_spec in zip(todo, specs):
                by_method.setdefault(run.stem, []).append(run_spec)
            results = [result for group in by_method.values() for result in runner(args.nice).run_sweep(group)]
        else:
            results = list(runner(args.nice).run_all(specs, jobs=args.jobs))
        # incomplete: clients left out, not tabulated
        failed = sum(result.status in ("failed", "incomplete") for result in results)
    rows = collect(runs)
    if not rows:
        message(f"error: paper-{args.table}: none of the {len(runs)} runs under {out / args.table} has finished, so "
                f"there is nothing to aggregate; run without --aggregate-only first")
        return 2
    columns = list(dict.fromkeys(r.column.label for r in runs))
    methods = [label for label, _ in spec.methods if any(r.method == label for r in runs)]
    title = spec.title + (f" — shortened: {args.rounds} rounds max" if args.rounds else "")
    paths = write_outputs(out, args.table, title, methods, columns, rows)
    output(f"wrote {paths['md']}, {paths['csv']}, {paths['png']} ({len(rows)}/{len(runs) + len(other)} runs finished"
           + (f"; {len(other)} of another configuration left out" if other else "") + ")")
    return 1 if failed or other else 0


def register(subparsers: Any) -> None:
    """Add ``paper-table2`` … ``paper-table6``."""
    for name, spec in TABLES.items():
        p = subparsers.add_parser(f"paper-{name.replace('table', 'table')}", help=spec.title)
        p.set_defaults(func=run_table, table=name)
        add_list_option(p, "--dataset", choices=sorted(DATASETS), default=None,
                        help=f"datasets (none given: {' '.join(spec.default_datasets)})")
        add_list_option(p, "--seeds", item_type=int, default=[0, 1, 2, 3, 4], help="seeds")
        add_list_option(p, "--methods", default=None, help="only these methods (labels or config stems; none: all)")
        add_list_option(p, "--columns", default=None,
                        help="only the columns whose label contains one of these (e.g. 'Dir(0.5)' 'eps=1'; none: all)")
        p.add_argument("--rounds", type=int, default=None, help="cap every run at this many rounds (shortened variant)")
        p.add_argument("--jobs", type=int, default=1, help="parallel fit processes")
        p.add_argument("--sweep", action="store_true",
                       help="fit each method's runs together in this process (python -m fedfdp.experiments sweep's "
                            "engine; methods it cannot batch are refused)")
        p.add_argument("--nice", type=int, default=0, help="niceness of the fit processes")
        p.add_argument("--out", default="runs/paper", help="output folder")
        p.add_argument("--config-dir", default="configs", help="folder of the per-dataset configs")
        p.add_argument("--aggregate-only", action="store_true", help="only aggregate the finished runs")
        add_dry_run(p)
        p.add_argument("--fit-args", nargs=argparse.REMAINDER, default=None,
                       help="extra arguments passed to every fedfdp.fit call (last option)")
