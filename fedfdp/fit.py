"""Command line: ``python -m fedfdp.fit --config configs/fmnist.yaml [--model.algorithm.init_args.fairness_weight 0.5]``.

The entry point: :func:`main` runs one federated run and turns its outcome into the process exit
status (0 done, 2 a user error as one ``error:`` line, 3 diverged, 128 + signal interrupted).
The command line itself is the :mod:`fedfdp.cli` package: the LightningCLI with its run-level
options and run-directory checks (:mod:`fedfdp.cli.parser`), the run's loggers
(:mod:`fedfdp.cli.loggers`), the run directory's lock during the fit
(:mod:`fedfdp.cli.rundir_guard`) and the one-line errors (:mod:`fedfdp.cli.errors`).

A run directory holds one run (:mod:`fedfdp.rundir`): a fresh start into a directory that holds
a run, a resume that would change the run, and a second process on a locked directory are
refused before anything is written; a resume needs no ``--config`` (the saved ``config.yaml``
is used), and its metrics, summary, report and progress bar continue those of the run.
"""

from __future__ import annotations

import sys
from typing import Any

# fedfdp.cli.parser first: it imports Lightning's CLI before the callbacks package, and --help lists
# the known Callback subclasses in import order (SaveConfigCallback before fedfdp's callbacks).
from fedfdp.cli.parser import FedFDPCLI, build_cli  # isort: skip
from callbacks.interrupt import exit_status
from fedfdp.cli.build_errors import construction_error
from fedfdp.cli.errors import (
    config_file_problem, config_paths, explain_parse_error, fedfdp_cause, lightning_config_error, one_line,
    write_failure,
)
from fedfdp.cli.log_setup import configure_logging
from fedfdp.cli.loggers import finish_wandb
from fedfdp.errors import DivergenceError

__all__ = ["EXIT_DIVERGED", "fit_run", "main", "report_error"]

#: Exit status of a run whose training diverged (non-finite model or loss).
EXIT_DIVERGED = 3


def main(args: list[str] | None = None) -> int:
    """Entry point; returns the process exit status.

    0: the run completed (or spent its privacy budget); 2: one ``error:`` line for a user error
    (configuration, data, a refused privacy claim or resume); 3: training diverged; 128 + signal
    (130 SIGINT, 143 SIGTERM): interrupted at a round boundary, checkpointed, resumable with
    ``--ckpt_path last``; 1: an unexpected error (a traceback).
    """
    configure_logging()
    argv = list(sys.argv[1:] if args is None else args)
    problem = next((p for p in map(config_file_problem, config_paths(argv)) if p), None)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    cli: FedFDPCLI | None = None
    try:
        cli = build_cli(args)
    except Exception as err:
        return report_error(err)
    return fit_run(cli)


def fit_run(cli: FedFDPCLI, prefix: str = "") -> int:
    """Fit the run that :func:`~fedfdp.cli.parser.build_cli` built; its exit status (see :func:`main`).

    ``prefix`` starts every ``error:`` line (a sweep names the run). Used by :func:`main` and by
    each run of a sweep (:mod:`fedfdp.sweep`).
    """
    failed = True
    try:
        ckpt = cli.config.get("ckpt_path")
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt)
        failed = False
        if cli.model.stop_signal is not None:
            return exit_status(cli.model.stop_signal)
    except (KeyboardInterrupt, SystemExit):
        # Lightning turns a KeyboardInterrupt (a second signal) into sys.exit(1)
        signum = getattr(getattr(cli, "model", None), "stop_signal", None)
        if signum is None:
            raise
        print(f"{prefix}error: interrupted by a second signal in round {cli.trainer.global_step + 1}, at once; resume "
              f"with --ckpt_path last from the last checkpoint", file=sys.stderr)
        return exit_status(signum)
    except Exception as err:
        return report_error(err, prefix, cli.config.as_dict())
    finally:
        finish_wandb(cli, failed)
    return 0


def report_error(err: Exception, prefix: str = "", config: dict[str, Any] | None = None) -> int:
    """Print the one ``error:`` line of a user error and return its exit status; re-raise anything else.

    jsonargparse wraps errors raised while instantiating union-typed values (callbacks, data) in its
    own ValueError: the FedFDPError inside, or the parse error, is reported as one line. A configured
    class that cannot be built is named from ``config`` (the run's, when it was parsed).
    """
    cause = fedfdp_cause(err)
    if cause is not None:
        print(f"{prefix}error: {one_line(str(cause))}", file=sys.stderr)
        return EXIT_DIVERGED if isinstance(cause, DivergenceError) else 2
    if type(err).__name__ == "ArgumentError":
        print(f"{prefix}error: {explain_parse_error(str(err))}", file=sys.stderr)
        return 2
    line = lightning_config_error(err) or construction_error(err, config) or write_failure(err)
    if line is not None:
        print(f"{prefix}error: {line}", file=sys.stderr)
        return 2
    raise err


if __name__ == "__main__":
    sys.exit(main())
