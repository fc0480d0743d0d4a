"""Run reports: ``report.md`` with PNG plots from a run directory, or a comparison of several runs.

Usage::

    python -m fedfdp.report RUN_DIR                      # writes RUN_DIR/report.md and RUN_DIR/plots/*.png
    python -m fedfdp.report RUN_A RUN_B ... --out DIR    # comparison: one plot per metric, one line per run

A run directory holds ``metrics.csv`` (one row per round, written by Lightning's CSVLogger; a
resumed run keeps one file for all its sessions, see :mod:`fedfdp.runlog`) and ``summary.json``
(written by :class:`callbacks.RunSummary`). Every run writes its report at the end, over all its
rounds.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import sys
import threading
from pathlib import Path
from typing import Any


from fedfdp import strict_yaml
from fedfdp.cli.errors import OneLineErrorParser
from fedfdp.participation import coverage_note, has_missing_clients
from fedfdp.rundir import PLOTS_DIR, SUMMARY_NAME, RunPaths, differing_settings

logger = logging.getLogger(__name__)

SERIES = {  # metric -> (title, y label, log scale)
    "accuracy": ("Pooled test accuracy of the global model", "accuracy", False),
    "psi_paper": ("Ψ: weighted variance of client test losses (Eq. 2)", "Ψ", True),
    "accuracy_worst": ("Worst-client test accuracy", "accuracy", False),
    "epsilon": ("Privacy spent ε (max over clients)", "ε", False),
    "broadcast_loss": ("Broadcast loss F̄_t", "loss", False),
    "client_factor_p50": ("Median fair-clip factor", "factor", False),
}


def read_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Per-metric ``[(round, value)]`` from ``metrics.csv`` (empty cells skipped)."""
    path = RunPaths(run_dir).metrics
    if not path.exists():
        return {}
    series: dict[str, list[tuple[int, float]]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            step = int(float(row.get("step") or 0)) + 1  # round t's metrics are logged at step t - 1
            for key, value in row.items():
                if key in ("step", "epoch") or value in ("", None):
                    continue
                series.setdefault(key, []).append((step, float(value)))
    return series


EVAL_KEYS = ("accuracy", "psi_paper", "accuracy_worst")


def read_series(run_dir: Path, summary: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """Per-round metrics from ``metrics.csv``; evaluation metrics from the summary's history."""
    last = int(summary.get("rounds_run") or 0)
    series = {k: [p for p in v if p[0] <= last] for k, v in read_metrics(run_dir).items()}
    history = summary.get("history") or []
    for key in EVAL_KEYS:
        points = [(int(h["round"]), float(h[key])) for h in history if key in h]
        if points:
            series[key] = points
    return series


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3, "font.size": 9})
    return plt


def _integer_rounds(ax: Any) -> None:
    """Round axes show whole rounds only (no 1.5 between rounds 1 and 2)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _line_plot(path: Path, title: str, ylabel: str, lines: dict[str, list[tuple[int, float]]], log: bool,
               hline: tuple[float, str] | None = None) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for label, points in lines.items():
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 40 else None,
                    label=label)
    positive = all(p[1] > 0 for pts in lines.values() for p in pts)
    if log and positive:
        ax.set_yscale("log")
    if hline is not None:
        ax.axhline(hline[0], color="#c0392b", ls="--", lw=1, label=hline[1])
        ax.legend(fontsize=7)
    ax.set(title=title, xlabel="round", ylabel=ylabel)
    _integer_rounds(ax)
    if len(lines) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


#: Above this many clients the per-client plot is a histogram (a bar per client would be unreadable,
#: and drawing 3,400 labelled bars takes half a minute).
MAX_CLIENT_BARS = 100


def _client_histogram(path: Path, summary: dict[str, Any]) -> None:
    plt = _plt()
    acc = summary["clients"]["accuracy"]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.hist(acc, bins=20, range=(0.0, 1.0), color="#2e86c1")
    ax.axvline(summary["final"]["accuracy"], color="k", ls="--", lw=1, label="pooled accuracy")
    ax.set(title=f"Test accuracy of the {len(acc)} clients after round {summary['rounds_run']}",
           xlabel="client test accuracy", ylabel="clients")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _client_bars(path: Path, summary: dict[str, Any]) -> None:
    acc = summary["clients"]["accuracy"]
    if len(acc) > MAX_CLIENT_BARS:
        _client_histogram(path, summary)
        return
    plt = _plt()
    sizes = summary["clients"]["train_size"]
    order = sorted(range(len(acc)), key=lambda i: acc[i])
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.bar(range(len(acc)), [acc[i] for i in order], color=["#c0392b" if k < max(1, len(acc) // 10) else "#2e86c1"
                                                            for k in range(len(acc))])
    ax.set_xticks(range(len(acc)), [f"{i}\n(n={sizes[i]})" for i in order], fontsize=6)
    ax.axhline(summary["final"]["accuracy"], color="k", ls="--", lw=1, label="pooled accuracy")
    ax.set(title=f"Per-client test accuracy after round {summary['rounds_run']} (sorted; worst in red)",
           xlabel="client (train size)", ylabel="accuracy", ylim=(0, 1))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _factor_plot(path: Path, metrics: dict[str, list[tuple[int, float]]]) -> bool:
    keys = ["client_factor_p05", "client_factor_p50", "client_factor_p95"]
    if not all(k in metrics for k in keys):
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    rounds = [p[0] for p in metrics["client_factor_p50"]]
    ax.fill_between(rounds, [p[1] for p in metrics["client_factor_p05"]], [p[1] for p in metrics["client_factor_p95"]],
                    alpha=0.3, label="5th-95th percentile")
    ax.plot(rounds, [p[1] for p in metrics["client_factor_p50"]], label="median")
    if "client_negative_fraction" in metrics:
        ax2 = ax.twinx()
        ax2.plot(rounds, [p[1] for p in metrics["client_negative_fraction"]], color="#c0392b", lw=0.8,
                 label="fraction negative")
        ax2.set_ylabel("fraction of negative coefficients", color="#c0392b")
    ax.set(title="Distribution of per-sample clip factors s_j over rounds", xlabel="round", ylabel="s_j")
    _integer_rounds(ax)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _summary(run_dir: Path) -> dict[str, Any]:
    """The run's ``summary.json``; FileNotFoundError (one line) when the folder or the file is missing."""
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} does not exist or is not a directory (expected a fedfdp run directory)")
    path = RunPaths(run_dir).summary
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no {SUMMARY_NAME} (not a fedfdp run directory, or no evaluation yet)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); the run may still be writing it") from err


def privacy_claim(summary: dict[str, Any]) -> str:
    """What the run's ε covers, in words (from ``dp_valid`` and ``evaluated_models_private``)."""
    if not summary.get("dp_valid"):
        return "none: not differentially private (some release has no guarantee, or no accountant)"
    if summary.get("evaluated_models_private") is False:
        return ("ε covers every release that left the clients, but NOT the evaluated models (trained on raw data "
                "and kept on the clients)")
    return "ε covers every release and every evaluated model"


_PLOTTING = threading.Lock()
"""matplotlib (pyplot's state, its text layout caches) is not thread-safe: the runs of a sweep
(:mod:`fedfdp.sweep`) write their reports from their own threads, one at a time."""


def write_report(run_dir: str | Path) -> Path:
    """Write ``report.md`` and ``plots/*.png`` for one run directory; returns the report path."""
    with _PLOTTING:
        return _write_report(Path(run_dir))


def _write_report(run_dir: Path) -> Path:
    summary = _summary(run_dir)
    metrics = read_series(run_dir, summary)
    plots = RunPaths(run_dir).plots
    plots.mkdir(exist_ok=True)
    images: list[tuple[str, str]] = []
    for key, (title, ylabel, log) in SERIES.items():
        if key == "epsilon" and summary.get("epsilon_unit") == "client":
            title = "Privacy spent ε (one client of the population)"
        if key in metrics:
            target = summary.get("target_epsilon") if key == "epsilon" else None
            _line_plot(plots / f"{key}.png", title, ylabel, {key: metrics[key]}, log,
                       hline=(target, f"target ε = {target}") if target else None)
            images.append((title, f"{PLOTS_DIR}/{key}.png"))
    final = summary.get("final")
    if final is not None:
        _client_bars(plots / "clients.png", summary)
        images.append(("Per-client accuracy", f"{PLOTS_DIR}/clients.png"))
    if _factor_plot(plots / "clip_factors.png", metrics):
        images.append(("Clip factors", f"{PLOTS_DIR}/clip_factors.png"))
    lines = [f"# Run report: {run_dir.name}", "",
             f"Algorithm **{summary['algorithm']}**, {summary['num_clients']} clients, "
             f"{summary['rounds_run']} of {summary['rounds_planned']} planned rounds"
             f"{'' if summary.get('status') is None else ', status **' + summary['status'] + '**'}.", ""]
    if has_missing_clients(summary):
        lines += ["**Not a complete run: clients were left out.**", "", *coverage_note(summary), ""]
    lines += ["| metric | value |", "|---|---|"]
    if final is None:  # stopped before its first evaluation: training metrics and privacy only
        lines[-2:-2] = [f"No evaluation yet: the run stopped after {summary['rounds_run']} rounds, before its first "
                        f"evaluation (every `model.eval_every` rounds). `python -m fedfdp.report {run_dir}` draws "
                        f"the accuracy once it has one.", ""]
    else:
        lines += [
            f"| pooled test accuracy (final{_covered(summary)}) | {final['accuracy']:.4f} |",
            f"| best pooled accuracy (round{_best_covered(summary)}) | {summary['best_accuracy']:.4f} "
            f"({summary['best_accuracy_round']}) |",
            f"| Ψ paper (global model, client test splits) | {final['psi_paper']:.4g} |",
            f"| Ψ train (global model, client train splits) | {_fmt(final.get('psi_train_global'))} |",
            f"| client accuracy: mean / std / worst / worst 10% | {final['accuracy_mean']:.4f} / "
            f"{final['accuracy_std']:.4f} / {final['accuracy_worst']:.4f} / {final['accuracy_worst10']:.4f} |",
            f"| Jain's index of client accuracy | {final['accuracy_jain']:.4f} |"]
    if "epsilon" in summary:
        lines.append(f"| ε spent (δ = {summary['delta']}) / target | {summary['epsilon']:.4f} / "
                     f"{_fmt(summary.get('target_epsilon'))} ({summary['accounting_mode']}) |")
        if summary.get("epsilon_unit") == "record":
            lines.append(f"| ε unit | record: one record of any of the {summary.get('num_clients')} clients "
                         f"(the largest ε over their ledgers) |")
        elif summary.get("epsilon_unit") == "client":
            client = (summary.get("privacy") or {}).get("client") or {}
            record = (summary.get("privacy") or {}).get("record") or {}
            lines.append(f"| ε unit | client: any one client of the population of {client.get('population')} "
                         f"(Poisson rate q = {_fmt(client.get('sampling_rate'))}, z = "
                         f"{_fmt(client.get('noise_multiplier'))}, {client.get('rounds')} rounds charged) |")
            if record:
                lines.append(f"| ε for one record (δ = {record.get('delta')}) | {_fmt(record.get('epsilon'))} |")
        if summary.get("privacy_mechanism"):
            lines.append(f"| privacy mechanism | {summary['privacy_mechanism']} |")
    if summary.get("releases_repeated"):  # a session was cut mid-round: its releases charged again on resume
        lines.append(f"| releases charged twice (a session cut mid-round, made again on resume) | "
                     f"{summary['releases_repeated']} |")
    lines.append(f"| privacy claim | {privacy_claim(summary)} |")
    lines.append(f"| seconds per round / peak memory | {_fmt(summary.get('seconds_per_round'))} s / "
                 f"{summary['peak_memory_mb']:.0f} MB |")
    if summary.get("wall_seconds") is not None:  # summaries written before wall time was recorded lack it
        lines.append(f"| wall time of the run (every session) / seed | {_fmt(summary['wall_seconds'])} s / "
                     f"{_fmt(summary.get('seed'))} |")
    lines.append("")
    for title, rel in images:
        lines += [f"## {title}", "", f"![{title}]({rel})", ""]
    report = RunPaths(run_dir).report
    report.write_text("\n".join(lines))
    return report


def _covered(summary: dict[str, Any]) -> str:
    """``", clients 0, 2 of 3"`` when the final figures do not cover every client, else empty."""
    evaluated, clients = summary.get("evaluated_clients"), summary.get("num_clients")
    if evaluated is None or clients is None or len(evaluated) >= int(clients):
        return ""
    return f", clients {', '.join(map(str, evaluated))} of {clients}"


def _best_covered(summary: dict[str, Any]) -> str:
    """``", clients 0, 2 of 3"`` when the best evaluation did not cover every client, else empty."""
    best = next((h for h in summary.get("history") or [] if h.get("round") == summary.get("best_accuracy_round")), {})
    covered = best.get("evaluated_clients")
    return "" if covered is None else f", clients {', '.join(map(str, covered))} of {summary.get('num_clients')}"


def write_comparison(run_dirs: list[Path], out: Path) -> Path:
    """One plot per metric with one line per run, plus a markdown table of final values, the settings
    in which the runs' configs differ, and the ε target on the ε plot when the runs share one."""
    summaries = {d: _summary(d) for d in run_dirs}
    out.mkdir(parents=True, exist_ok=True)
    runs = {_label(d, run_dirs): (read_series(d, summaries[d]), summaries[d]) for d in run_dirs}
    lines = ["# Run comparison", "", "| run | algorithm | rounds | accuracy | Ψ paper | worst client | ε |",
             "|---|---|---|---|---|---|---|"]
    for label, (_, s) in runs.items():
        f = s.get("final") or {}  # a run stopped before its first evaluation has none
        rounds = f"{s['rounds_run']} (clients left out)" if has_missing_clients(s) else s["rounds_run"]
        lines.append(f"| {label} | {s['algorithm']} | {rounds} | {_fmt(f.get('accuracy'))} | {_fmt(f.get('psi_paper'))} "
                     f"| {_fmt(f.get('accuracy_worst'))} | {_fmt(s.get('epsilon'))} |")
    lines += ["", *_settings_section(run_dirs, list(runs)), *_identical_note(runs)]
    targets = {s.get("target_epsilon") for _, s in runs.values()}
    target = next(iter(targets)) if len(targets) == 1 else None
    for key, (title, ylabel, log) in SERIES.items():
        series = {label: m[key] for label, (m, _) in runs.items() if key in m}
        if series:
            hline = (target, f"target ε = {target}") if key == "epsilon" and target else None
            _line_plot(out / f"{key}.png", title, ylabel, series, log, hline=hline)
            lines += [f"## {title}", "", f"![{title}]({key}.png)", ""]
    report = out / "comparison.md"
    report.write_text("\n".join(lines))
    return report


def _settings_section(run_dirs: list[Path], labels: list[str]) -> list[str]:
    """The settings in which the runs' saved configs differ (``config.yaml``), as a table."""
    configs = []
    for run_dir in run_dirs:
        path = RunPaths(run_dir).config
        if not path.is_file():
            return ["The runs' settings cannot be compared: " + f"{path} is missing.", ""]
        configs.append(strict_yaml.load(path.read_text()) or {})
    differing = differing_settings(configs)
    if not differing:
        return ["The runs' configs are identical (but for where each run is and how it is shown).", ""]
    out = ["## Settings that differ", "", "| setting | " + " | ".join(labels) + " |",
           "|---|" + "---|" * len(labels)]
    out += [f"| `{path}` | " + " | ".join(_fmt(v) for v in values) + " |" for path, values in differing]
    return [*out, ""]


def _identical_note(runs: dict[str, tuple[dict[str, list[tuple[int, float]]], dict[str, Any]]]) -> list[str]:
    """A warning when every run's accuracy curve is the same: a changed setting that changed nothing."""
    curves = [m.get("accuracy") for m, _ in runs.values()]
    if len(curves) > 1 and curves[0] and all(c == curves[0] for c in curves[1:]):
        return ["**The runs' accuracy curves are identical**: the settings above did not change what was "
                "trained (e.g. the fairness weight λ at a clip bound that every sample exceeds).", ""]
    return []


def _label(run_dir: Path, all_dirs: list[Path]) -> str:
    names = [d.name for d in all_dirs]
    return run_dir.name if names.count(run_dir.name) == 1 else f"{run_dir.parent.name}/{run_dir.name}"


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m fedfdp.report``."""
    parser = OneLineErrorParser(prog="python -m fedfdp.report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help=f"run directories (each with {SUMMARY_NAME})")
    parser.add_argument("--out", type=Path, default=None, help="output folder of a comparison of several runs")
    args = parser.parse_args(argv)
    try:
        if len(args.run_dirs) == 1 and args.out is None:
            print(write_report(args.run_dirs[0]))
        else:
            print(write_comparison(args.run_dirs, args.out or Path("comparison")))
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyError as err:
        print(f"error: a {SUMMARY_NAME} lacks the key {err} (written by an older fedfdp?)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
