"""FinP comparison harness (``python -m fedfdp.experiments finp-table``): FinP seed 003, Tables 1/3 layout.

Rows: the baseline FedAvg, FinP_client, FinP_server(PCA/ALA), FinP(PCA/ALA) (spec §1.8), a β
ablation, DP rows (DP-FedAvg, FinP + DP-SGD, FedFDP, each with the same SIA/MIA audit), and the
references every table here carries (group ``alone``): each client alone without and with DP-SGD
(the FinP loop's local optimiser, and the DP rows' q, C, σ and steps) and each client predicting the
majority label of its training split (computed, not trained). Nothing leaves a client in those rows,
so they have no SIA or MIA columns: there is no upload to attack. Each run is one subprocess ``python -m fedfdp.fit --config <config> --run_dir <out>/<row>/seed<k>
--seed_everything k <overrides>`` launched by :class:`fedfdp.experiments.runner.Runner`
(finished runs are skipped, interrupted ones resumed); the first failed run stops the command.
The table holds the mean over seeds. Columns
follow spec §3: train / test accuracy = mean over the last 5 evaluations; Mean(SIA) = mean over
rounds of the client-mean SIA accuracy, Max(SIA) = its maximum over rounds (both %); CoV, FI, EOD,
CoV(Loss), FI(Loss) = means over rounds; Converge = first round ≥ 0.98 × final level that stays
there; plus MIA AUC of the final global model, ε and seconds per round.
"""

from __future__ import annotations

import argparse
import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from fedfdp import strict_yaml
from fedfdp.experiments._common import add_dry_run, add_list_option, message, output
from fedfdp.experiments.identity import distinct_rows
from fedfdp.experiments.results import finished_summary
from fedfdp.experiments.runner import Runner, RunSpec
from fedfdp.analysis.sia_metrics import convergence_round


A = "--model.algorithm.init_args."
# the configs a row names, resolved per dataset (Dataset below)
CONFIG, DP_CONFIG, FEDFDP_CONFIG = "finp", "dp", "fedfdp"
LOCAL_CONFIG, LOCAL_DP_CONFIG, MAJORITY = "local", "local_dp", "majority"  # MAJORITY: FinP's split, no run
FEDAVG = ["{fedavg}"]  # the dataset's FedAvg baseline overrides


@dataclass(frozen=True)
class Dataset:
    """The configs of one dataset's rows: FinP's, the DP rows' (None: no DP rows), FedFDP's (None: no
    FedFDP row), each client alone without and with DP-SGD (None: no such row), and the overrides that
    turn the FinP config into the FedAvg baseline. The majority-label row reads FinP's split."""

    config: str
    baseline: list[str]
    dp_config: str | None = None
    fedfdp_config: str | None = None
    local_config: str | None = None
    local_dp_config: str | None = None

    def path(self, kind: str) -> str | None:
        return {CONFIG: self.config, DP_CONFIG: self.dp_config, FEDFDP_CONFIG: self.fedfdp_config,
                LOCAL_CONFIG: self.local_config, LOCAL_DP_CONFIG: self.local_dp_config, MAJORITY: self.config}[kind]

    def label_values(self) -> dict[str, str]:
        """β of the FinP and DP configs, σ of the DP config: the values the row labels show."""
        def init_args(path: str | None) -> dict[str, Any]:
            return strict_yaml.load(Path(path).read_text())["model"]["algorithm"]["init_args"] if path else {}

        def sigma(args: dict[str, Any]) -> str:
            mechanism = (args.get("privacy") or {}).get("init_args") or {}
            return f"{mechanism['noise_multiplier']:g}" if "noise_multiplier" in mechanism else "?"

        finp, dp, local_dp = init_args(self.config), init_args(self.dp_config), init_args(self.local_dp_config)
        return {"beta": f"{finp.get('beta', '?'):g}" if "beta" in finp else "?",
                "dp_beta": f"{dp['beta']:g}" if "beta" in dp else "?",
                "sigma": sigma(dp), "local_sigma": sigma(local_dp)}


# FinP with both parts off is FedAvg exactly (same loop and local optimizer, n_k weights, nothing extra uploaded)
SAME_LOOP_FEDAVG = [A + "client_reg", "false", A + "server_agg", "size_fedavg"]
DATASETS: dict[str, Dataset] = {
    "fmnist": Dataset("configs/finp_fmnist.yaml", ["--model.algorithm", "fedfdp.algorithms.FedAvg", A + "lr", "0.05",
                                                    A + "local_epochs", "2", A + "batch_size", "32"],
                      "configs/finp_fmnist_dp.yaml", "configs/fedfdp_fmnist_sia.yaml",
                      "configs/finp_fmnist_local.yaml", "configs/finp_fmnist_local_dp.yaml"),
    # FinP's own CNN (HuCNN) and Adam, 5 local epochs of batch 64 (spec §4.2); its baseline is FedAvg
    # with the same Adam loop
    "fmnist_cnn": Dataset("configs/finp_fmnist_cnn.yaml", SAME_LOOP_FEDAVG, "configs/finp_fmnist_cnn_dp.yaml",
                          local_config="configs/finp_fmnist_cnn_local.yaml",
                          local_dp_config="configs/finp_fmnist_cnn_local_dp.yaml"),
    "synthetic_har": Dataset("configs/finp_synthetic_har.yaml", SAME_LOOP_FEDAVG,
                             local_config="configs/finp_synthetic_har_local.yaml"),
}
# row name -> (group, label, config kind, overrides); {beta}, {dp_beta}, {sigma}: the dataset's values
ROWS: dict[str, tuple[str, str, str, list[str]]] = {
    "baseline": ("main", "Baseline (FedAvg)", CONFIG, FEDAVG),
    "finp_client": ("main", "FinP_client (β={beta})", CONFIG, [A + "server_agg", "size_fedavg"]),
    "finp_server_pca": ("main", "FinP_server (PCA)", CONFIG, [A + "client_reg", "false"]),
    "finp_pca": ("main", "FinP (PCA, β={beta})", CONFIG, []),
    "finp_server_ala": ("main", "FinP_server (ALA)", CONFIG, [A + "client_reg", "false", A + "server_agg", "ala"]),
    "finp_ala": ("main", "FinP (ALA, β={beta})", CONFIG, [A + "server_agg", "ala"]),
    "finp_pca_b0.1": ("beta", "FinP (PCA, β=0.1)", CONFIG, [A + "beta", "0.1"]),
    "finp_pca_b0.5": ("beta", "FinP (PCA, β=0.5)", CONFIG, [A + "beta", "0.5"]),
    "finp_ala_b0.1": ("beta", "FinP (ALA, β=0.1)", CONFIG, [A + "server_agg", "ala", A + "beta", "0.1"]),
    "finp_ala_b0.5": ("beta", "FinP (ALA, β=0.5)", CONFIG, [A + "server_agg", "ala", A + "beta", "0.5"]),
    "finp_ala_b8": ("beta", "FinP (ALA, β=8)", CONFIG, [A + "server_agg", "ala", A + "beta", "8"]),
    "dpfedavg": ("dp", "DP-FedAvg (σ={sigma})", DP_CONFIG, ["--model.algorithm", "fedfdp.algorithms.FedAvg"]),
    "dpfinp_server_ala": ("dp", "FinP_server (ALA) + DP-SGD", DP_CONFIG, [A + "client_reg", "false"]),
    "dpfinp_ala_b0.1": ("dp", "FinP (ALA, β=0.1) + DP-SGD", DP_CONFIG, [A + "beta", "0.1"]),
    "dpfinp_ala": ("dp", "FinP (ALA, β={dp_beta}) + DP-SGD", DP_CONFIG, []),
    "fedfdp": ("dp", "FedFDP (λ=0.1)", FEDFDP_CONFIG, []),
    "local": ("alone", "Each client alone, no DP", LOCAL_CONFIG, []),
    "local_dp": ("alone", "Each client alone, DP-SGD (σ={local_sigma})", LOCAL_DP_CONFIG, []),
    "majority": ("alone", "Majority label of each client", MAJORITY, []),
}
GROUPS = ("main", "beta", "dp", "alone")
COLUMNS = [("train_acc", "Train acc %"), ("test_acc", "Test acc %"), ("sia_mean", "Mean(SIA) %"),
           ("sia_max", "Max(SIA) %"), ("sia_cov", "CoV(SIA)"), ("sia_fi", "FI(SIA)"), ("loss_cov", "CoV(Loss)"),
           ("loss_fi", "FI(Loss)"), ("eod", "EOD"), ("converge", "Converge"), ("mia_auc", "MIA AUC"),
           ("epsilon", "ε"), ("sec_round", "s/round")]


def register(subparsers: Any) -> None:
    """Add the ``finp-table`` command."""
    p = subparsers.add_parser("finp-table", help="FedAvg vs FinP-PCA vs FinP-ALA, β ablation, DP rows (SIA audit)")
    p.add_argument("--dataset", default="fmnist", choices=sorted(DATASETS), help="which FinP config the rows use")
    add_list_option(p, "--rows", default=list(GROUPS), help=f"groups ({', '.join(GROUPS)}) and/or row names")
    add_list_option(p, "--seeds", item_type=int, default=[0], help="seeds")
    p.add_argument("--rounds", type=int, default=None, help="override model.num_rounds (default: the config's 20)")
    p.add_argument("--out", default="runs/finp_table", help="root of the run directories")
    p.add_argument("--markdown", default=None, help="write the table here (default: <out>/table.md)")
    add_dry_run(p)
    p.set_defaults(func=run)


def selected_rows(spec: str | list[str]) -> list[str]:
    """Row names from groups and/or names (a list, or one comma-separated string)."""
    items = spec.split(",") if isinstance(spec, str) else spec
    wanted = [s.strip() for s in items if s.strip()]
    unknown = [w for w in wanted if w not in ROWS and w not in {g for g, *_ in ROWS.values()}]
    if unknown:
        raise ValueError(f"--rows got unknown {unknown}; accepted: {', '.join(GROUPS)} or {sorted(ROWS)}")
    return [name for name, (group, *_) in ROWS.items() if name in wanted or group in wanted]


def run_spec(name: str, seed: int, out: Path, rounds: int | None, dataset: str = "fmnist") -> RunSpec:
    """The run of row ``name`` and ``seed``: ``<out>/<name>/seed<seed>``."""
    _, _, kind, overrides = ROWS[name]
    data = DATASETS[dataset]
    config = data.path(kind)
    if config is None:
        raise ValueError(f"row {name} has no config for --dataset {dataset}")
    args = ["--trainer.enable_progress_bar", "false", "--wandb", "disabled",
            *(data.baseline if overrides == FEDAVG else overrides)]
    if rounds is not None:
        args += ["--model.num_rounds", str(rounds)]
    return RunSpec(run_dir=out / name / f"seed{seed}", config=Path(config), seed=seed, args=tuple(args))


def distinct_table_rows(rows: list[str], seed: int, out: Path, rounds: int | None,
                        dataset: str) -> tuple[list[str], dict[str, str]]:
    """``rows`` without those that train an earlier row's configuration on ``dataset`` (a row whose
    override restates the config's value, e.g. ``dpfinp_ala_b0.1`` where the DP config's β is 0.1),
    and ``{dropped: the row it repeats}``; the majority row trains nothing and is always kept."""
    trained = [r for r in rows if ROWS[r][2] != MAJORITY]
    _, same = distinct_rows(trained, lambda name: run_spec(name, seed, out, rounds, dataset))
    return [r for r in rows if r not in same], same


def row_label(name: str, dataset: str) -> str:
    """Row ``name``'s label with the dataset's β and σ."""
    return ROWS[name][1].format(**DATASETS[dataset].label_values())


def row_values(summary: dict[str, Any]) -> dict[str, float | None]:
    """One run's table values (spec §3)."""
    final, hist = summary["final"], summary["history"]
    last = hist[-5:]
    conv = convergence_round([h["round"] for h in hist], [h["accuracy"] for h in hist])
    return {"train_acc": 100 * sum(h.get("train_accuracy", float("nan")) for h in last) / len(last),
            "test_acc": 100 * sum(h["accuracy"] for h in last) / len(last),
            "sia_mean": final.get("sia_table_mean"), "sia_max": final.get("sia_table_max"),
            "sia_cov": final.get("sia_cov_avg"), "sia_fi": final.get("sia_fi_avg"),
            "loss_cov": final.get("sia_loss_cov_avg"), "loss_fi": final.get("sia_loss_fi_avg"),
            "eod": final.get("sia_eod_avg"), "converge": conv, "mia_auc": final.get("mia_auc"),
            "epsilon": summary.get("epsilon"), "sec_round": summary.get("seconds_per_round")}


def majority_row_values(config: str) -> dict[str, float | None]:
    """The majority-label row: each client predicts the most frequent label of its training split
    (:func:`fedfdp.experiments.baselines.majority_label_baseline` on ``config``'s split), scored on
    its training and test splits (pooled, %); it trains nothing and releases nothing."""
    from fedfdp.experiments.baselines import datamodule_from_config, majority_label_baseline

    datamodule = datamodule_from_config(config, labels_only=True)
    values: dict[str, float | None] = {key: None for key, _ in COLUMNS}
    values["train_acc"] = 100 * majority_label_baseline(datamodule, "train")["pooled"]
    values["test_acc"] = 100 * majority_label_baseline(datamodule, "test")["pooled"]
    return values


def _fmt(value: float | None, key: str) -> str:
    if value is None:
        return "–"
    if key == "converge":
        return f"round {int(value)}"
    return f"{value:.2f}" if key in ("train_acc", "test_acc", "sia_mean", "sia_max", "epsilon", "sec_round") \
        else f"{value:.3f}"


def run(args: argparse.Namespace) -> int:
    """Run the missing rows, then write the markdown table and a CSV."""
    out = Path(args.out)
    seeds = list(args.seeds)
    try:
        rows = selected_rows(args.rows)
    except ValueError as err:
        message(f"error: finp-table: {err}")
        return 2
    data = DATASETS[args.dataset]
    rows = [r for r in rows if data.path(ROWS[r][2]) is not None]  # rows the dataset has no config for
    rows, repeated = distinct_table_rows(rows, seeds[0], out, args.rounds, args.dataset)
    for name, same in repeated.items():
        message(f"finp-table: row {name} trains the same configuration as row {same} on --dataset "
                f"{args.dataset}: run and tabulated once, as {same}")
    runner = Runner(env={"WANDB_MODE": "disabled"})
    trained = [r for r in rows if ROWS[r][2] != MAJORITY]
    specs = {(name, seed): run_spec(name, seed, out, args.rounds, args.dataset) for name in trained for seed in seeds}
    if args.dry_run:  # the dry run's output is the list of commands
        return runner.dry_run(specs.values())
    for result in runner.run_all(specs.values()):
        if result.status in ("failed", "incomplete"):
            message(f"error: finp-table: {result.spec.run_dir} failed (exit {result.returncode}): "
                    f"{result.error_line} (see {result.log})")
            return result.returncode
    lines = ["| Method | " + " | ".join(label for _, label in COLUMNS) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    records = []
    for name in rows:
        if name in trained:
            summaries = [finished_summary(specs[name, s].run_dir) for s in seeds]
            if any(summary is None for summary in summaries):  # only complete runs are tabulated
                message(f"error: finp-table: no finished run in {out / name} for every seed "
                        f"{' '.join(map(str, seeds))}")
                return 1
            values = [row_values(summary) for summary in summaries]
            mean = {k: (sum(v[k] for v in values) / len(values) if all(v[k] is not None for v in values) else None)
                    for k, _ in COLUMNS}
        else:  # the majority label: computed from the split, the same for every seed
            mean = majority_row_values(data.config)
        label = row_label(name, args.dataset)
        records.append({"row": name, "label": label, "seeds": len(seeds) if name in trained else 0, **mean})
        lines.append(f"| {label} | " + " | ".join(_fmt(mean[k], k) for k, _ in COLUMNS) + " |")
    table = "\n".join(lines) + "\n"
    md = Path(args.markdown) if args.markdown else out / "table.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(table)
    with open(out / "table.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    output(table)
    return 0
