"""Table of complete runs (mean ± std over seeds) from their run directories.

    python docs/complete_runs/tabulate.py [--plot PNG] LABEL=DIR [LABEL=DIR ...]

Each DIR holds ``seed<k>/`` run directories (``summary.json``, ``privacy_ledger.jsonl`` or ``.jsonl.gz``). Columns:
final pooled / worst-client / worst-10 % accuracy, the same three as the mean over the last 5
evaluations (one final evaluation is noisy, issue 12), Ψ, Jain, ε by RDP (the run's accountant)
and by PRV (recomputed from the ledger with Opacus' PRVAccountant), rounds, wall time.
``--plot PNG`` also draws worst-client against pooled accuracy (means of the last 5 evaluations),
one point per method, error bars one standard deviation over its seeds.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

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


def row(run_dir: Path) -> dict[str, float]:
    s = json.loads((run_dir / "summary.json").read_text())
    final, evals = s["final"], [h for h in s["history"] if "accuracy_worst" in h][-5:]
    last5 = {k: statistics.fmean(h[k] for h in evals) for k in ("accuracy", "accuracy_worst", "accuracy_worst10")}
    return {"pooled": 100 * final["accuracy"], "worst": 100 * final["accuracy_worst"],
            "worst10": 100 * final["accuracy_worst10"], "pooled5": 100 * last5["accuracy"],
            "worst5": 100 * last5["accuracy_worst"], "worst10_5": 100 * last5["accuracy_worst10"],
            "psi": final["psi"], "jain": final["accuracy_jain"], "eps_rdp": s["epsilon"],
            "eps_prv": _prv(run_dir, s["delta"]), "rounds": s["rounds_run"], "wall_min": s["wall_seconds"] / 60}


def _cell(values: list[float], digits: int) -> str:
    if len(set(round(v, digits) for v in values)) == 1:  # one seed, or every seed alike
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


COLUMNS = [("pooled", 2), ("worst", 2), ("worst10", 2), ("pooled5", 2), ("worst5", 2), ("worst10_5", 2),
           ("psi", 3), ("jain", 3), ("eps_rdp", 3), ("eps_prv", 3), ("rounds", 0), ("wall_min", 1)]
HEADER = ("| method | seeds | pooled % | worst client % | worst 10 % | pooled, last 5 | worst, last 5 | "
          "worst 10 %, last 5 | Ψ | Jain | ε RDP | ε PRV | rounds | wall min |")


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
    parser.add_argument("methods", nargs="+", metavar="LABEL=DIR")
    args = parser.parse_args(argv)
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    methods: list[tuple[str, list[dict[str, float]]]] = []
    for spec in args.methods:
        label, folder = spec.split("=", 1)
        runs = sorted(p for p in Path(folder).glob("seed*") if (p / "summary.json").exists())
        if not runs:
            parser.error(f"{folder} holds no seed*/summary.json")
        rows = [row(p) for p in runs]
        methods.append((label, rows))
        seeds = " ".join(p.name.removeprefix("seed") for p in runs)
        print(f"| {label} | {seeds} | " + " | ".join(_cell([r[k] for r in rows], d) for k, d in COLUMNS) + " |")
    for spec in args.methods:
        for p in sorted(Path(spec.split("=", 1)[1]).glob("seed*")):
            if (p / "summary.json").exists():
                print(f"<!-- {spec.split('=', 1)[0]} {p.name}: " + json.dumps({k: round(v, 4) for k, v in row(p).items()})
                      + " -->")
    if args.plot is not None:
        lines = [(a, float(v), text) for a, v, text in (spec.split("=", 2) for spec in args.line)]
        plot(args.plot, methods, lines)


if __name__ == "__main__":
    main(sys.argv[1:])
