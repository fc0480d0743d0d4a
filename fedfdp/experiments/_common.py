"""Options every ``python -m fedfdp.experiments`` command shares, so they all read the same way.

* List options (``--seeds``, ``--methods``, ``--rows``, ``--epsilons``, ``--dataset``) take
  space-separated values (``--seeds 0 1 2``); comma lists (``--seeds 0,1,2``) are still accepted.
* ``--dry-run`` (also spelled ``--dry_run``) prints the ``fedfdp.fit`` commands a command would
  run, one a line, and runs and writes nothing.
* A usage error is one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any

from fedfdp.cli.errors import OneLineErrorParser

__all__ = ["OneLineErrorParser", "add_dry_run", "add_list_option", "print_command"]


class _ListAction(argparse.Action):
    """Collects space-separated values, splitting comma lists and converting each item."""

    def __init__(self, *args: Any, item_type: Callable[[str], Any] = str, allowed: Sequence[Any] | None = None,
                 **kwargs: Any) -> None:
        self.item_type, self.allowed = item_type, allowed
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        items = [part.strip() for value in ([values] if isinstance(values, str) else values or [])
                 for part in str(value).split(",") if part.strip()]
        if not items:
            parser.error(f"{option_string} needs at least one value")
        converted = []
        for item in items:
            try:
                converted.append(self.item_type(item))
            except ValueError:
                name = getattr(self.item_type, "__name__", "value")
                parser.error(f"{option_string}: {item!r} is not a valid {name}")
        if self.allowed is not None:
            bad = [c for c in converted if c not in self.allowed]
            if bad:
                parser.error(f"{option_string}: {', '.join(map(str, bad))} not among "
                             f"{', '.join(map(str, self.allowed))}")
        setattr(namespace, self.dest, converted)


def add_list_option(parser: argparse.ArgumentParser, name: str, *, item_type: Callable[[str], Any] = str,
                    default: list[Any] | None = None, choices: Sequence[Any] | None = None, help: str = "") -> None:
    """Add ``name`` taking one or more values: ``--seeds 0 1 2`` or, as before, ``--seeds 0,1,2``."""
    shown = " ".join(map(str, default)) if default else "none"
    metavar = name.lstrip("-").upper()
    parser.add_argument(name, nargs="+", action=_ListAction, item_type=item_type, allowed=choices, default=default,
                        metavar=metavar[:-1] if metavar.endswith("S") else metavar,
                        help=f"{help} (space-separated; comma lists also accepted; default: {shown})")


def add_dry_run(parser: argparse.ArgumentParser) -> None:
    """Add ``--dry-run`` (alias ``--dry_run``): print the commands, run and write nothing."""
    parser.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                        help="print the fedfdp.fit commands that would run, one a line; run and write nothing")


def output(text: str) -> None:
    """Write the command's result to stdout: a table, a command to run, where files were written.

    The experiment commands keep stdout for what a user reads or pipes; progress goes to
    ``logging`` (stderr) and errors and notes to :func:`message`.
    """
    sys.stdout.write(f"{text}\n")
    sys.stdout.flush()


def message(text: str) -> None:
    """Write one line for the reader to stderr: an ``error: ...`` line or a note beside the result."""
    sys.stderr.write(f"{text}\n")


def print_command(cmd: Sequence[str]) -> None:
    """Print one command of a dry run (shell-quoted, so it can be pasted)."""
    output(shlex.join(str(c) for c in cmd))
