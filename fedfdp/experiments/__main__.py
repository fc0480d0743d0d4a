"""Dispatch ``python -m fedfdp.experiments <command>`` to the harness modules of this package."""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys

import fedfdp.experiments as package
from fedfdp.cli.log_setup import StderrHandler
from fedfdp.experiments._common import OneLineErrorParser
from fedfdp.experiments.stop_signals import HarnessInterrupted


def build_parser() -> argparse.ArgumentParser:
    """A parser with one sub-command per harness registered by the package's modules."""
    parser = OneLineErrorParser(prog="python -m fedfdp.experiments", description=package.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        if hasattr(module, "register"):
            module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse and run one harness command; returns its exit status."""
    # the handler writes to sys.stderr as it is at each record (tests and harnesses swap it)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=[StderrHandler()])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except HarnessInterrupted as err:  # the fits ended their round and checkpointed (stop_signals)
        logging.getLogger("fedfdp.experiments").error("error: %s", err)
        return 128 + err.signum


if __name__ == "__main__":
    sys.exit(main())
