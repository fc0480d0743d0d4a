"""Experiment harnesses: ``python -m fedfdp.experiments <command> ...``.

Each module in this package that defines ``register(subparsers)`` adds one or more commands
(for example a paper table). ``register`` adds an ``argparse`` sub-parser and sets its ``func``
default to a callable taking the parsed namespace and returning an exit status.
"""
