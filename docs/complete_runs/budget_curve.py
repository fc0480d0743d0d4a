"""Budget curves of tuning studies: the best validation objective against the number of finished trials.

    python docs/complete_runs/budget_curve.py --out docs/complete_runs/tuning/budget_curve.png \
        "local-only DP-SGD=runs/tune/ranked/local_dp_scatter" "DP-FedAvg + fine-tuning=..." ...

Each ``LABEL=DIR`` names a study directory of ``python -m fedfdp.experiments tune`` (its
``study.db``; the study is the only one in it). A curve is the running maximum of the objective
over the study's finished trials in trial order (validation data only: the objective is what the
study maximised). A flat tail says more trials would not have changed the winner; a curve still
rising at its last trial says the ranking may move with a larger budget. The script also prints
one line per study: trials finished, the best value and the trial that reached it, and the trial
from which the best value was within 0.005 of its final value.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import optuna  # noqa: E402


def running_best(study_dir: Path) -> list[float]:
    """The best objective after each finished trial (trial order) of the study in ``study_dir``."""
    storage = f"sqlite:///{study_dir / 'study.db'}"
    names = optuna.get_all_study_names(storage)
    if len(names) != 1:
        raise SystemExit(f"error: {study_dir / 'study.db'} holds {len(names)} studies, expected one")
    study = optuna.load_study(study_name=names[0], storage=storage)
    values = [t.value for t in sorted(study.trials, key=lambda t: t.number)
              if t.state == optuna.trial.TrialState.COMPLETE and t.value is not None]
    best: list[float] = []
    for v in values:
        best.append(v if not best else max(best[-1], v))
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("studies", nargs="+", metavar="LABEL=DIR")
    parser.add_argument("--out", type=Path, required=True, help="the figure (PNG)")
    parser.add_argument("--ylabel", default="best validation score\n(pooled + worst-client accuracy)")
    parser.add_argument("--ylim", type=float, nargs=2, default=None, metavar=("LOW", "HIGH"),
                        help="the y range (a study far below the others otherwise flattens them)")
    args = parser.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for spec in args.studies:
        label, _, folder = spec.partition("=")
        if not folder:
            raise SystemExit(f"error: expected LABEL=DIR, got {spec!r}")
        best = running_best(Path(folder))
        if not best:
            print(f"{label}: no finished trial")
            continue
        settled = next(k for k, v in enumerate(best) if v >= best[-1] - 0.005) + 1
        print(f"{label}: {len(best)} trials, best {best[-1]:.4f} (first reached at finished trial "
              f"{best.index(best[-1]) + 1}; within 0.005 of it from finished trial {settled})")
        ax.plot(range(1, len(best) + 1), best, label=f"{label} ({len(best)} trials)", drawstyle="steps-post")
    if args.ylim is not None:
        ax.set_ylim(*args.ylim)
    ax.set_xlabel("finished trials")
    ax.set_ylabel(args.ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
