"""Command line: ``python -m fedfdp.audit --config configs/population/fmnist_client_dp.yaml [--canaries 1000] [fit options]``.

Trains the config once with canaries (``callbacks.CanaryAudit``: each of ``--canaries`` included
with probability ½; with ``SampleLevelDP`` gradient canaries in client ``--audit_client``'s data,
added to its clipped sums before the mechanism's noise; with ``ClientLevelDP`` canary clients,
clipped and noised with the cohort) and ends with one line::

    audit: claimed epsilon X; empirical lower bound Y (95 % confidence, white-box: every round's aggregate seen); ...

The same figures are in the run directory's ``summary.json`` under ``audit``. Every option of
``python -m fedfdp.fit`` applies (``--model.num_rounds 20``, ``--run_dir``, ...); the exit status is
fit's. An audit run is a run of its own: its canaries move the model.
"""

from __future__ import annotations

import argparse
import sys

from fedfdp.cli.parser import build_cli  # isort: skip  (before the callbacks, as in fedfdp.fit)
from fedfdp.cli.errors import config_file_problem, config_paths
from fedfdp.cli.log_setup import configure_logging
from fedfdp.fit import fit_run, report_error

__all__ = ["fit_arguments", "main"]


def _audit_options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--canaries", type=int, default=1000)
    parser.add_argument("--audit_confidence", type=float, default=0.95)
    parser.add_argument("--audit_seed", type=int, default=0)
    parser.add_argument("--canary_scale", type=float, default=1.0)
    parser.add_argument("--audit_client", type=int, default=0)
    return parser.parse_known_args(argv)


def fit_arguments(argv: list[str]) -> list[str]:
    """The ``python -m fedfdp.fit`` arguments of an audit: the run's own, and the canary callback."""
    options, rest = _audit_options(argv)
    return [*rest, "--trainer.callbacks+=callbacks.CanaryAudit",
            f"--trainer.callbacks.init_args.canaries={options.canaries}",
            f"--trainer.callbacks.init_args.confidence={options.audit_confidence}",
            f"--trainer.callbacks.init_args.seed={options.audit_seed}",
            f"--trainer.callbacks.init_args.canary_scale={options.canary_scale}",
            f"--trainer.callbacks.init_args.client={options.audit_client}"]


def main(args: list[str] | None = None) -> int:
    """Entry point; returns the process exit status (as :func:`fedfdp.fit.main`)."""
    configure_logging()
    fit_args = fit_arguments(list(sys.argv[1:] if args is None else args))
    problem = next((p for p in map(config_file_problem, config_paths(fit_args)) if p), None)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        cli = build_cli(fit_args)
    except Exception as err:
        return report_error(err)
    status = fit_run(cli)
    audits = [cb for cb in cli.trainer.callbacks if type(cb).__name__ == "CanaryAudit"]
    if status == 0 and audits and audits[0].result is not None:
        print(audits[0].line())
    return status


if __name__ == "__main__":
    sys.exit(main())
