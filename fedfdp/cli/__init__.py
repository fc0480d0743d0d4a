"""The command line of ``python -m fedfdp.fit`` (:mod:`fedfdp.fit` is its entry point and exit statuses).

One module per responsibility:

* :mod:`fedfdp.cli.parser`: :class:`~fedfdp.cli.parser.FedFDPCLI` (a LightningCLI) and
  :func:`~fedfdp.cli.parser.build_cli`: options, parsing, the run-directory checks before a start,
  and the trainer with its default loggers and callbacks.
* :mod:`fedfdp.cli.loggers`: the run's loggers, ``metrics.csv`` and the W&B run (mode, run id).
* :mod:`fedfdp.cli.rundir_guard`: :class:`~fedfdp.cli.rundir_guard.RunDirGuard`, which holds the run
  directory's lock during the fit, and what a stopped run keeps.
* :mod:`fedfdp.cli.trainer_options`: Lightning ``Trainer`` options refused or hidden from ``--help``.
* :mod:`fedfdp.cli.errors`: one clear ``error:`` line for each command-line mistake.
* :mod:`fedfdp.cli.log_setup`: logging of the command-line entry points (also the Flower apps').

Nothing is imported here: :mod:`fedfdp.cli.errors` and :mod:`fedfdp.cli.log_setup` stay light for
the harnesses and the Flower ClientApp that use them without Lightning's CLI.
"""
