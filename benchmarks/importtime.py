"""What starting fedfdp imports, and how long it takes: this checkout side by side with another.

For each entry point below, a fresh Python process is started (``--repeats``
times, the median is printed) in this checkout and, with ``--before DIR``, in another checkout
(e.g. ``git worktree add /tmp/before <rev>``), and the table gives per checkout:

* ``project modules``: how many modules of ``fedfdp``, ``callbacks`` and ``datamodules`` the
  process imported (deterministic);
* ``algorithm modules``: how many of those are ``fedfdp.algorithms.*`` modules;
* ``seconds``: the process's wall-clock time from start to exit (for ``--help``: printing the
  help), median over the repeats;

and the ratio before / after of the seconds. Timings on a loaded machine are noisy; the
module counts are not.

Usage::

    python benchmarks/importtime.py [--before /tmp/before] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: name → the python arguments of the process.
ENTRY_POINTS: dict[str, list[str]] = {
    "fedfdp.fit --help": ["-m", "fedfdp.fit", "--help"],
    "import fedfdp.fit": ["-c", "import fedfdp.fit"],
    "one algorithm (FedAvg)": ["-c", "import fedfdp.algorithms as a; a.FedAvg"],
    "Flower ClientApp module": ["-c", "import fedfdp.flower.client_app"],
}
PROJECT = ("fedfdp", "callbacks", "datamodules")


_PROBE = """
import atexit, json, os, runpy, sys
def _report():
    names = [m for m in sys.modules if m.split('.')[0] in {project!r}]
    os.write(2, ("FEDFDP_IMPORTS " + json.dumps(names) + "\\n").encode())
atexit.register(_report)
sys.argv = {argv!r}
{run}
"""


def measure(checkout: Path, args: list[str]) -> tuple[int, int, float]:
    """(project modules, algorithm modules, seconds) of one fresh process running ``args``.

    The modules are read from ``sys.modules`` at exit: ``-X importtime`` misses modules imported
    through :func:`importlib.import_module` (the lazy registry's way), so it cannot count them.
    """
    if args[0] == "-m":
        run, argv = f"runpy.run_module({args[1]!r}, run_name='__main__')", [args[1], *args[2:]]
    else:
        run, argv = args[1], ["-c"]
    code = _PROBE.format(project=PROJECT, argv=argv, run=run)
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", WANDB_MODE="disabled", PYTHONPATH=str(checkout))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env, capture_output=True, text=True,
                          check=False)
    seconds = time.perf_counter() - start
    line = next(line for line in proc.stderr.splitlines() if line.startswith("FEDFDP_IMPORTS "))
    modules = json.loads(line.split(" ", 1)[1])
    algorithms = sum(1 for m in modules if m.startswith("fedfdp.algorithms."))
    return len(modules), algorithms, seconds


def row(checkout: Path, args: list[str], repeats: int) -> tuple[int, int, float]:
    runs = [measure(checkout, args) for _ in range(repeats)]
    return runs[0][0], runs[0][1], statistics.median(r[2] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, default=None, help="another checkout to compare with")
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    header = f"{'entry point':26} | {'project modules':>17} | {'algorithm modules':>17} | {'seconds':>15} | before/after"
    print(header)
    print("-" * len(header))
    for name, args in ENTRY_POINTS.items():
        after = row(ROOT, args, opts.repeats)
        if opts.before is None:
            print(f"{name:26} | {after[0]:>17} | {after[1]:>17} | {after[2]:>15.2f} |")
            continue
        before = row(opts.before, args, opts.repeats)
        print(f"{name:26} | {before[0]:>7} -> {after[0]:>6} | {before[1]:>7} -> {after[1]:>6} | "
              f"{before[2]:>6.2f} -> {after[2]:>5.2f} | {before[2] / after[2]:.2f}x")


if __name__ == "__main__":
    main()
