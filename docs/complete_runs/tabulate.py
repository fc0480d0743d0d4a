"""Table of complete runs (mean ± std over seeds) from their run directories.

    python docs/complete_runs/tabulate.py LABEL=DIR [LABEL=DIR ...]

Each DIR holds ``seed<k>/`` run directories (``summary.json``, ``privacy_ledger.jsonl`` or ``.jsonl.gz``). Columns:
final pooled / worst-client / worst-10 % accuracy, the same three as the mean over the last 5
evaluations (one final evaluation is noisy, issue 12), Ψ, Jain, ε by RDP (the run's accountant)
and by PRV (recomputed from the ledger with Opacus' PRVAccountant), rounds, wall time.
"""

from __future__ import annotations

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
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


COLUMNS = [("pooled", 2), ("worst", 2), ("worst10", 2), ("pooled5", 2), ("worst5", 2), ("worst10_5", 2),
           ("psi", 3), ("jain", 3), ("eps_rdp", 3), ("eps_prv", 3), ("rounds", 0), ("wall_min", 1)]
HEADER = ("| method | seeds | pooled % | worst client % | worst 10 % | pooled, last 5 | worst, last 5 | "
          "worst 10 %, last 5 | Ψ | Jain | ε RDP | ε PRV | rounds | wall min |")


def main(argv: list[str]) -> None:
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    for spec in argv:
        label, folder = spec.split("=", 1)
        runs = sorted(p for p in Path(folder).glob("seed*") if (p / "summary.json").exists())
        rows = [row(p) for p in runs]
        seeds = " ".join(p.name.removeprefix("seed") for p in runs)
        print(f"| {label} | {seeds} | " + " | ".join(_cell([r[k] for r in rows], d) for k, d in COLUMNS) + " |")
    for spec in argv:
        for p in sorted(Path(spec.split("=", 1)[1]).glob("seed*")):
            if (p / "summary.json").exists():
                print(f"<!-- {spec.split('=', 1)[0]} {p.name}: " + json.dumps({k: round(v, 4) for k, v in row(p).items()})
                      + " -->")


if __name__ == "__main__":
    main(sys.argv[1:])
