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

# fedfdp.cli.parser first: it imports Lightning's CLI before the callbacks package, and --help lists
# the known Callback subclasses in import order (SaveConfigCallback before fedfdp's callbacks).
from fedfdp.cli.parser import FedFDPCLI, build_cli  # isort: skip
from callbacks.interrupt import exit_status
from fedfdp.cli.build_errors import construction_error
from fedfdp.cli.errors import (
    config_file_problem, config_paths, explain_parse_error, fedfdp_cause, lightning_config_error, one_line,
)
from fedfdp.cli.log_setup import configure_logging
from fedfdp.cli.loggers import finish_wandb
from fedfdp.errors import DivergenceError

__all__ = ["EXIT_DIVERGED", "main"]

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
    failed = True
    try:
        cli = build_cli(args)
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
        print(f"error: interrupted by a second signal in round {cli.trainer.global_step + 1}, at once; resume with "
              f"--ckpt_path last from the last checkpoint", file=sys.stderr)
        return exit_status(signum)
    except Exception as err:
        # jsonargparse wraps errors raised while instantiating union-typed values (callbacks, data)
        # in its own ValueError: report the FedFDPError inside, or the parse error, as one line.
        cause = fedfdp_cause(err)
        if cause is not None:
            print(f"error: {one_line(str(cause))}", file=sys.stderr)
            return EXIT_DIVERGED if isinstance(cause, DivergenceError) else 2
        if type(err).__name__ == "ArgumentError":
            print(f"error: {explain_parse_error(str(err))}", file=sys.stderr)
            return 2
        line = lightning_config_error(err) or construction_error(err, cli.config.as_dict() if cli else None)
        if line is not None:
            print(f"error: {line}", file=sys.stderr)
            return 2
        raise
    finally:
        finish_wandb(cli, failed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
