"""Run a fedfdp entry point with one process fault injected at a named point (test-only, no hook in fedfdp).

Usage::

    python tests/fault_inject.py POINT WHEN N SIGNAL -- -m fedfdp.fit --config ...
    python tests/fault_inject.py --count COUNTS_JSON -- -m fedfdp.fit --config ...

The first form sends ``SIGNAL`` (``KILL`` or ``TERM``) to this process at the ``N``-th call (1-based) of
``POINT``'s function, ``before`` or ``after`` the call runs, or ``mid`` (half of the bytes written,
for the points that write a file). The second form counts the calls of every point and writes the
counts to ``COUNTS_JSON`` at exit: the range a generator draws ``N`` from.

Points (where a run writes what a resume depends on):

- ``round``: ``Federation.training_step`` (one call a round);
- ``ledger_append``: ``LedgerFile.append`` (a round's or a one-off release's privacy-ledger lines);
- ``ledger_sync``: ``LedgerFile.sync`` (the fsync before a round's uploads leave);
- ``checkpoint``: Lightning's ``_atomic_save`` (``last.ckpt``; ``mid``: cut inside the file write);
- ``summary``: ``write_json_atomic`` (``summary.json``, ``progress.json``);
- ``metrics``: ``MergingExperimentWriter.save`` (``metrics.csv``).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import signal
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

POINTS: dict[str, tuple[str, str | None, str]] = {
    "round": ("fedfdp.federation", "Federation", "training_step"),
    "ledger_append": ("fedfdp.privacy.ledger_file", "LedgerFile", "append"),
    "ledger_sync": ("fedfdp.privacy.ledger_file", "LedgerFile", "sync"),
    "checkpoint": ("lightning.fabric.plugins.io.torch_io", None, "_atomic_save"),
    "summary": ("callbacks.summary", None, "write_json_atomic"),
    "metrics": ("fedfdp.runlog", "MergingExperimentWriter", "save"),
}
"""point -> (module, class or None, function): the function patched where the code calls it."""

WRITES_FILES = {"checkpoint"}
"""Points with a ``mid`` variant: the kill lands after half of the file's bytes are written."""

SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM}


def _owner(point: str) -> tuple[Any, str]:
    module_name, cls, name = POINTS[point]
    module = importlib.import_module(module_name)
    return (getattr(module, cls) if cls else module), name


def _patch(point: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    owner, name = _owner(point)
    setattr(owner, name, wrap(getattr(owner, name)))


def _mid_write_kill(sig: int) -> None:
    """Cut the next checkpoint file write after half of its bytes (fsspec's local file, as Lightning writes)."""
    from fsspec.implementations.local import LocalFileOpener

    original = LocalFileOpener.write

    def write(self: Any, data: bytes, *args: Any, **kwargs: Any) -> Any:
        original(self, data[: len(data) // 2])
        self.flush()
        os.kill(os.getpid(), sig)
        return original(self, data[len(data) // 2:], *args, **kwargs)

    LocalFileOpener.write = write


def inject(point: str, when: str, nth: int, sig: int) -> None:
    """Patch ``point`` so that its ``nth`` call sends ``sig`` to this process (``when``: before, after, mid)."""
    calls = Counter[str]()

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def patched(*args: Any, **kwargs: Any) -> Any:
            calls[point] += 1
            hit = calls[point] == nth
            if hit and when == "before":
                os.kill(os.getpid(), sig)
            if hit and when == "mid":
                _mid_write_kill(sig)
            result = fn(*args, **kwargs)
            if hit and when == "after":
                os.kill(os.getpid(), sig)
            return result

        return patched

    _patch(point, wrap)


def count_calls(out_path: str) -> None:
    """Count every point's calls; write ``{point: count}`` to ``out_path`` at exit."""
    calls = Counter[str]()
    for point in POINTS:
        def wrap(fn: Callable[..., Any], point: str = point) -> Callable[..., Any]:
            def counted(*args: Any, **kwargs: Any) -> Any:
                calls[point] += 1
                return fn(*args, **kwargs)
            return counted
        _patch(point, wrap)
    atexit.register(lambda: open(out_path, "w").write(json.dumps({p: calls[p] for p in POINTS})))


def main(argv: list[str]) -> None:
    split = argv.index("--")
    ours, target = argv[:split], argv[split + 1:]
    if ours[0] == "--count":
        count_calls(ours[1])
    else:
        point, when, nth, sig = ours
        assert point in POINTS and when in ("before", "after", "mid"), ours
        inject(point, when, int(nth), SIGNALS[sig])
    assert target[0] == "-m", "the target is a module: -m fedfdp.fit ..."
    sys.argv = [target[1], *target[2:]]
    runpy.run_module(target[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main(sys.argv[1:])
