"""Generated bad inputs through the command line (:mod:`tests.input_generator`): never a traceback.

Every case runs ``fedfdp.fit.main`` in-process on its family's tiny config with one option set
to a boundary or malformed value, and must end in one of the documented ways:

* exit 0 with an honest ``summary.json``: status ``completed`` or ``budget_spent``, at least one
  round, finite final metrics, and an ε that is finite and within its target when one is claimed;
  and not for -1 (no count, size, rate, weight or tolerance of a run is negative: an option that
  accepts -1 silently is a missing range check), but for the options of :data:`NEGATIVE_OK`;
* exit 2 with exactly one ``error:`` line (a refused start leaves no run directory behind);
* exit 3 with exactly one ``error:`` line and ``summary.json`` saying ``diverged`` (a value that
  makes training diverge, e.g. a learning rate of 1e30, is caught as divergence).

Never exit 1, never a traceback. :func:`tests.input_generator.default_sample` runs by default;
the full set (a few thousand cases) runs with ``pytest -m input_fuzz tests/cli/test_input_generator.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from fedfdp.fit import main
from tests.input_generator import Case, all_cases, default_sample, families, family_config, path_value

SAMPLE = default_sample()
_SAMPLE_IDS = {c.id for c in SAMPLE}
REST = [c for c in all_cases() if c.id not in _SAMPLE_IDS]
_FAMILIES = {f.name: f for f in families()}
#: options that accept a negative value, and why
NEGATIVE_OK = {"trainer.log_every_n_steps": "Lightning's own option; a period <= 0 only stops per-step logging",
               "model.server_optimizer.init_args.dampening": "torch.optim.SGD's own option, which torch accepts"}


@dataclass
class Outcome:
    """What one invocation did: exit status, its ``error:`` lines, a traceback (if any) and the run directory."""

    code: int | None
    errors: list[str]
    traceback: str | None
    run_dir: Path


def invoke(case: Case, tmp: Path) -> Outcome:
    """Run ``case`` through ``fedfdp.fit.main`` in-process, capturing stderr."""
    config = family_config(_FAMILIES[case.family], tmp)
    run_dir = tmp / "run"
    value = case.value
    if value.startswith("path:"):
        if value == "path:unreadable" and os.geteuid() == 0:
            pytest.skip("root reads a file whatever its mode: an unreadable file cannot be made here")
        value = str(path_value(value, tmp))
    args = ["--config", str(config), "--run_dir", str(run_dir)]
    if not case.key:
        pass
    elif case.key == "config":
        args += ["--config", value]
    elif case.key == "run_dir":
        run_dir = Path(value)
        args[-1] = value
    else:
        args.append(f"--{case.key}={value}")
    err = io.StringIO()
    trace = None
    code: int | None
    with contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as exit_:  # argparse-style exits are fine only as status 2 with one line
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:  # noqa: BLE001 - a traceback is exactly what the test reports
            code, trace = None, traceback.format_exc()
    errors = [line for line in err.getvalue().splitlines() if line.startswith("error:")]
    if "Traceback (most recent call last)" in err.getvalue():
        trace = trace or err.getvalue()[-3000:]
    return Outcome(code, errors, trace, run_dir)


def _finite(value: object) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def problems(outcome: Outcome, case: Case) -> list[str]:
    """Why ``outcome`` of ``case`` is not an accepted end (empty when it is)."""
    fresh_run_dir = case.key != "run_dir"
    if outcome.traceback is not None:
        return [f"traceback:\n{outcome.traceback}"]
    if not case.key and outcome.code != 0:
        return [f"the family's tiny config itself exits {outcome.code}: {outcome.errors}"]
    if outcome.code in (2, 3):
        found = [] if len(outcome.errors) == 1 else [f"exit {outcome.code} with error lines {outcome.errors}"]
        if outcome.code == 3:
            summary = _summary(outcome.run_dir)
            if summary is None or summary.get("status") != "diverged":
                found.append("exit 3 without a summary.json saying diverged")
        elif fresh_run_dir and (outcome.run_dir / "summary.json").exists():
            summary = _summary(outcome.run_dir) or {}
            if summary.get("rounds_run", 0) == 0:
                found.append("a refused start left a summary.json behind")
        return found
    if outcome.code != 0:
        return [f"exit status {outcome.code} (errors: {outcome.errors})"]
    summary = _summary(outcome.run_dir)
    if summary is None:
        return ["exit 0 without summary.json"]
    found = []
    if case.value == "-1" and case.key not in NEGATIVE_OK:
        found.append("-1 accepted silently (a missing range check)")
    if summary.get("status") not in ("completed", "budget_spent"):
        found.append(f"exit 0 with status {summary.get('status')}")
    if not summary.get("rounds_run"):
        found.append("exit 0 after no round")
    final = summary.get("final") or {}
    found += [f"final {k} = {v}" for k, v in final.items() if not _finite(v)]
    epsilon, target = summary.get("epsilon"), summary.get("target_epsilon")
    if epsilon is not None and not (_finite(epsilon) and (target is None or epsilon <= target * (1 + 1e-9))):
        found.append(f"epsilon {epsilon} with target {target}")
    return found


def _summary(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def _check(case: Case, tmp: Path) -> None:
    outcome = invoke(case, tmp)
    found = problems(outcome, case)
    assert not found, f"{case.id}: " + "; ".join(found)


@pytest.mark.parametrize("case", SAMPLE, ids=[c.id for c in SAMPLE])
def test_generated_input_sample(case: Case, tmp_path: Path) -> None:
    """The cheap deterministic sample: every test run."""
    _check(case, tmp_path)


@pytest.mark.input_fuzz
@pytest.mark.parametrize("case", REST, ids=[c.id for c in REST])
def test_generated_input_full(case: Case, tmp_path: Path) -> None:
    """The rest of the generated set: ``pytest -m input_fuzz tests/cli/test_input_generator.py``."""
    _check(case, tmp_path)


def test_generator_covers_every_shipped_family_and_value_kind() -> None:
    """Each shipped class has options and cases; the sample spans numbers, strings, paths and several families."""
    cases = all_cases()
    covered = {c.family for c in cases}
    assert set(_FAMILIES) - {"client:ClientModule"} <= covered
    assert len(cases) > 1000 and 40 <= len(SAMPLE) <= 80
    values = {c.value for c in SAMPLE}
    for value in ("0", "-1", "1e-300", "1e300", ".inf", ".nan", "abc", "", str(2**40), "path:junk"):
        assert value in values, value
    assert len({c.family for c in SAMPLE}) >= 15


def test_every_net_family_has_a_tiny_config() -> None:
    """Every net that a shipped config names (a generated family) gets a tiny config here, so a new
    net in a config cannot wait for the full fuzz run to fail on a missing entry."""
    nets = [f for f in _FAMILIES.values() if f.name.startswith("net:")]
    assert nets
    with tempfile.TemporaryDirectory() as tmp:
        for family in nets:
            config = yaml.safe_load(family_config(family, Path(tmp)).read_text())
            assert config["model"]["client"]["init_args"]["net"]["class_path"] == family.class_path, family.name
