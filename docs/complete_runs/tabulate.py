"""Table of complete runs (mean ± std over seeds) from their run directories.

    python docs/complete_runs/tabulate.py [--plot PNG] [--majority LABEL=CONFIG] LABEL=DIR [LABEL=DIR ...]

Each DIR holds ``seed<k>/`` run directories (``summary.json``, ``privacy_ledger.jsonl`` or ``.jsonl.gz``; the
committed runs keep their per-round history gzipped, ``metrics.csv.gz``, and their ledger as ``.jsonl.gz``). Columns:
final pooled / worst-client / worst-10 % accuracy, the same three as the mean over the last 5
evaluations (one final evaluation is noisy, issue 12), Ψ, Jain, ε by RDP (the run's accountant)
and by PRV (recomputed from the ledger with Opacus' PRVAccountant; "—" for a run that is not DP), and
which models that ε covers (``yes``: every evaluated model; ``NO, ...``: the run releases privately
but evaluates models trained on raw data, e.g. DP-Ditto's personal models kept on the client;
``not DP``), rounds, wall time. Only complete runs are tabulated: a seed whose summary says it
did not complete (``status`` not ``completed``/``budget_spent``, fewer rounds than planned, or
clients left out of rounds or of the final evaluation) is left out and named in a comment line.
``--plot PNG`` also draws worst-client against pooled accuracy (means of the last 5 evaluations),
one point per method, error bars one standard deviation over its seeds.
``--majority LABEL=CONFIG`` adds a row computed without training: each client predicts the most
frequent label of its own training split (:mod:`fedfdp.experiments.baselines`), on the split of
CONFIG (a config or a run's ``config.yaml``), scored on the same test splits; it has no seeds,
rounds or ε, and its last-5 columns equal its final ones.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from fedfdp.participation import has_missing_clients
from fedfdp.privacy.accounting import DPEvent, prv_epsilon


def _prv(run_dir: Path, delta: float) -> float:
    """The largest per-client PRV ε over the events of the run's ledger."""
    per_client: dict[int, list[DPEvent]] = defaultdict(list)
    path = run_dir / "privacy_ledger.jsonl"
    text = path.read_text() if path.exists() else gzip.decompress((run_dir / "privacy_ledger.jsonl.gz").read_bytes()).decode()
    for line in text.splitlines():
        e = json.loads(line)
        per_client[e["client"]].append(DPEvent(noise_multiplier=e["sigma"], sample_rate=e["q"], steps=e["steps"]))
    return max(prv_epsilon(events, delta) for events in per_client.values())


def complete(summary: dict) -> bool:
    """Whether a run ran to its end (its round count or its privacy budget) with every client: a run
    with clients left out of rounds or of its final evaluation (``completed_with_missing_clients``,
    ``missing_clients``, ``evaluated_clients``) is not complete."""
    if has_missing_clients(summary):
        return False
    if "status" in summary:
        return summary["status"] in ("completed", "budget_spent")
    return summary["rounds_run"] >= summary["rounds_planned"]  # summaries written before ``status``


def covers(run_dir: Path, summary: dict) -> str:
    """Which models the run's ε covers (``evaluated_models_private``; derived from the config for
    summaries written before that field: DP-Ditto with ``private_personal: false`` evaluates
    personal models trained by plain SGD on the client)."""
    if not summary.get("dp_valid") or summary.get("epsilon") is None:
        return "not DP"
    private = summary.get("evaluated_models_private")
    if private is None:
        import yaml

        from fedfdp.algorithms.retired import upgrade_config  # configs saved before privacy= (DPDitto)

        config = upgrade_config(yaml.safe_load((run_dir / "config.yaml").read_text()) or {})
        algorithm = config["model"]["algorithm"]
        init_args = algorithm.get("init_args") or {}
        private = not (algorithm["class_path"].endswith(".Ditto") and init_args.get("privacy")
                       and init_args.get("private_personal") is False)
    return "yes" if private else "NO: evaluated models not private"


def row(run_dir: Path) -> dict[str, float]:
    s = json.loads((run_dir / "summary.json").read_text())
    final, evals = s["final"], [h for h in s["history"] if "accuracy_worst" in h][-5:]
    last5 = {k: statistics.fmean(h[k] for h in evals) for k in ("accuracy", "accuracy_worst", "accuracy_worst10")}
    return {"pooled": 100 * final["accuracy"], "worst": 100 * final["accuracy_worst"],
            "worst10": 100 * final["accuracy_worst10"], "pooled5": 100 * last5["accuracy"],
            "worst5": 100 * last5["accuracy_worst"], "worst10_5": 100 * last5["accuracy_worst10"],
            "psi": final["psi"], "jain": final["accuracy_jain"], "eps_rdp": s.get("epsilon"),
            "eps_prv": _prv(run_dir, s["delta"]) if s.get("epsilon") is not None else None,
            "rounds": s["rounds_run"], "wall_min": s["wall_seconds"] / 60}


def majority_row(config: Path) -> dict[str, float]:
    """The majority-label baseline of ``config``'s data split, in :func:`row`'s accuracy columns."""
    from fedfdp.experiments.baselines import datamodule_from_config, majority_label_baseline

    b = majority_label_baseline(datamodule_from_config(config, labels_only=True))
    return {"pooled": 100 * b["pooled"], "worst": 100 * b["worst"], "worst10": 100 * b["worst10"],
            "pooled5": 100 * b["pooled"], "worst5": 100 * b["worst"], "worst10_5": 100 * b["worst10"],
            "jain": b["jain"]}


def _cell(values: list[float | None], digits: int) -> str:
    if any(v is None for v in values):
        return "—"
    if len(set(round(v, digits) for v in values)) == 1:  # one seed, or every seed alike
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


COLUMNS = [("pooled", 2), ("worst", 2), ("worst10", 2), ("pooled5", 2), ("worst5", 2), ("worst10_5", 2),
           ("psi", 3), ("jain", 3), ("eps_rdp", 3), ("eps_prv", 3), ("rounds", 0), ("wall_min", 1)]
HEADER = ("| method | seeds | pooled % | worst client % | worst 10 % | pooled, last 5 | worst, last 5 | "
          "worst 10 %, last 5 | Ψ | Jain | ε RDP | ε PRV | ε covers evaluated models | rounds | wall min |")
#: where the coverage column stands among the cells of COLUMNS
_COVERS_AT = [k for k, _ in COLUMNS].index("rounds")


def plot(path: Path, methods: list[tuple[str, list[dict[str, float]]]],
         lines: list[tuple[str, float, str]] = ()) -> None:
    """Worst-client vs pooled accuracy (last-5 means), one point per method, ±1 std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 6.5))
    for label, rows in methods:
        xs, ys = [r["pooled5"] for r in rows], [r["worst5"] for r in rows]
        std = (lambda v: statistics.stdev(v) if len(v) > 1 else 0.0)
        ax.errorbar(statistics.fmean(xs), statistics.fmean(ys), xerr=std(xs), yerr=std(ys), fmt="o", capsize=3,
                    label=f"{label.replace('`', '')} ({len(rows)} seed{'s' if len(rows) > 1 else ''})")
    for axis, value, label in lines:  # reference lines: a paper's claim, a target
        (ax.axvline if axis == "x" else ax.axhline)(value, ls="--", lw=1, color="grey")
        if axis == "x":
            ax.annotate(label, (value, 0.02), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                        ha="right", va="bottom")
        else:
            ax.annotate(label, (0.01, value), xycoords=("axes fraction", "data"), fontsize=7, va="bottom")
    ax.set_xlabel("pooled test accuracy %, mean of the last 5 evaluations")
    ax.set_ylabel("worst-client test accuracy %, same")
    ax.set_title("FashionMNIST, Dir(0.1), 10 clients, ε = 3.52, δ = 1e-5 (complete runs)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12))  # below the axes: never over a point
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot", type=Path, default=None, help="also write this PNG (worst vs pooled)")
    parser.add_argument("--line", action="append", default=[], metavar="x|y=VALUE=LABEL",
                        help="a dashed reference line on the plot, e.g. 'x=85.99=paper claim'")
    parser.add_argument("--majority", action="append", default=[], metavar="LABEL=CONFIG",
                        help="a row: each client predicts its training split's majority label (CONFIG's split)")
    parser.add_argument("methods", nargs="*", metavar="LABEL=DIR")
    args = parser.parse_args(argv)
    if not args.methods and not args.majority:
        parser.error("give at least one LABEL=DIR or --majority LABEL=CONFIG")
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    for spec in args.majority:
        label, config = spec.split("=", 1)
        r = majority_row(Path(config))
        cells = [_cell([r[k]], d) if k in r else "—" for k, d in COLUMNS]
        cells.insert(_COVERS_AT, "no training")
        print(f"| {label} | — | " + " | ".join(cells) + " |")
    methods: list[tuple[str, list[dict[str, float]]]] = []
    for spec in args.methods:
        label, folder = spec.split("=", 1)
        found = sorted(p for p in Path(folder).glob("seed*") if (p / "summary.json").exists())
        summaries = {p: json.loads((p / "summary.json").read_text()) for p in found}
        runs = [p for p in found if complete(summaries[p])]
        for p in sorted(set(found) - set(runs)):
            print(f"<!-- {label} {p.name}: not complete ({summaries[p].get('status', 'no status')}, round "
                  f"{summaries[p]['rounds_run']} of {summaries[p]['rounds_planned']}): left out -->")
        if not runs:
            parser.error(f"{folder} holds no complete seed*/summary.json")
        rows = [row(p) for p in runs]
        methods.append((label, rows))
        seeds = " ".join(p.name.removeprefix("seed") for p in runs)
        cells = [_cell([r[k] for r in rows], d) for k, d in COLUMNS]
        coverage = sorted({covers(p, summaries[p]) for p in runs})
        cells.insert(_COVERS_AT, " / ".join(coverage))
        print(f"| {label} | {seeds} | " + " | ".join(cells) + " |")
    for spec in args.methods:
        for p in sorted(Path(spec.split("=", 1)[1]).glob("seed*")):
            if (p / "summary.json").exists() and complete(json.loads((p / "summary.json").read_text())):
                print(f"<!-- {spec.split('=', 1)[0]} {p.name}: "
                      + json.dumps({k: (round(v, 4) if v is not None else None) for k, v in row(p).items()}) + " -->")
    if args.plot is not None:
        lines = [(a, float(v), text) for a, v, text in (spec.split("=", 2) for spec in args.line)]
        plot(args.plot, methods, lines)


if __name__ == "__main__":
    # this file's folder leaves the import path: torch's exit hook (imported with torchvision by
    # --majority's datamodule) imports the ``tabulate`` package, which this script would shadow
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    main(sys.argv[1:])
