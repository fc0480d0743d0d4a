"""Process faults found by a generator: a run killed at a random point of what it writes, then resumed.

Each case kills a short private run (``tests/configs/tiny_fedfdp.yaml``: FedFDP, sample-level DP,
noisy loss reporting, RDP accounting, a checkpoint every round) with SIGKILL or SIGTERM at the N-th
call of one of the points where it writes what a resume rests on (``tests/fault_inject.py``: a
round, a privacy-ledger append, the ledger's fsync, a checkpoint write, cut before, after or in the
middle of its bytes, a summary write, a metrics write), then does what ``docs/running.md`` says:
the same command with ``--ckpt_path last``, unless the summary says the run ended. The generator draws the point, the moment, N (from the calls an uninterrupted run makes) and the signal.

After the resume, against the uninterrupted run:
- the summary says ``completed`` with the same rounds, and the final model is equal bit for bit;
- ε is never below the uninterrupted run's, and where it is above, ``releases_repeated`` says why;
- no release is lost: every ledger line of the uninterrupted run is in the resumed ledger;
- ``metrics.csv`` holds each round once, and no temporary file is left behind.

A sample of the cases runs in every test run; all of them with ``pytest -m process_fuzz
tests/cli/test_process_faults.py``. Not covered here: the harnesses (``tune``, sweeps: their stop
tests are in ``tests/experiments/test_stop_signals.py``) and Flower deployments
(``tests/flower/test_flower_deployment.py`` kills and restarts SuperNodes).
"""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO

ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_WAIT_POLICY": "PASSIVE"}
TINY = str(REPO / "tests" / "configs" / "tiny_fedfdp.yaml")
INJECT = str(REPO / "tests" / "fault_inject.py")
ROUNDS = 6
POINTS = ["round", "ledger_append", "ledger_sync", "checkpoint", "summary", "metrics"]
ALL_CASES = 48
CI_SAMPLE = [3, 5, 11, 26, 37]
"""Generator seeds run in every test run. Two were failures, fixed at the root: seed 5 (SIGTERM during the
last round) left the run ``interrupted`` with nothing to resume (``callbacks.interrupt``: it now ends as
planned); seed 37 (SIGKILL after the last checkpoint, before the run's end was written) left it
``running`` for ever, refused by every resume (a resume now finishes it: ``Federation.unfinished_run``)."""


def _fit_args(run_dir: Path, *extra: str) -> list[str]:
    return ["-m", "fedfdp.fit", "--config", TINY, "--run_dir", str(run_dir), "--model.num_rounds", str(ROUNDS),
            "--checkpoint_every", "1", "--trainer.callbacks+=callbacks.RunSummary",
            "--trainer.callbacks.report", "false", *extra]


def _run(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted run and the number of calls of each point it makes."""
    root = tmp_path_factory.mktemp("reference")
    counts = root / "counts.json"
    done = _run([INJECT, "--count", str(counts), "--", *_fit_args(root / "run")])
    assert done.returncode == 0, done.stderr[-2000:]
    return {"dir": root / "run", "counts": json.loads(counts.read_text())}


def case(seed: int, counts: dict[str, int]) -> tuple[str, str, int, str]:
    """Generator seed -> (point, when, nth call, signal)."""
    rng = random.Random(seed)
    point = rng.choice(POINTS)
    when = rng.choice(["before", "after", "mid"] if point == "checkpoint" else ["before", "after"])
    return point, when, rng.randint(1, counts[point]), rng.choice(["KILL", "TERM"])


def _final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    return {k: v for k, v in ckpt["state_dict"].items() if k.startswith("global_model.")}


def _ledger(run_dir: Path) -> Counter:
    return Counter(line for line in (run_dir / "privacy_ledger.jsonl").read_text().splitlines() if line.strip())


def _metric_rounds(run_dir: Path) -> list[int]:
    with (run_dir / "metrics.csv").open(newline="") as f:
        return [int(row["round"]) for row in csv.DictReader(f)]


def check_resumed_run(run_dir: Path, reference_dir: Path, label: str) -> None:
    """The invariants of the module docstring."""
    summary = json.loads((run_dir / "summary.json").read_text())
    expected = json.loads((reference_dir / "summary.json").read_text())
    assert summary["status"] == expected["status"] and summary["rounds_run"] == expected["rounds_run"], label
    assert summary["final"] == expected["final"] and summary["history"] == expected["history"], label
    model, expected_model = _final_model(run_dir), _final_model(reference_dir)
    assert model.keys() == expected_model.keys() and all(torch.equal(model[k], expected_model[k]) for k in model), \
        f"{label}: the resumed run's final model differs from the uninterrupted run's"
    assert summary["epsilon"] >= expected["epsilon"] - 1e-12, f"{label}: less epsilon than released"
    if summary["epsilon"] > expected["epsilon"] + 1e-12:
        assert summary["releases_repeated"] > 0, f"{label}: a higher epsilon without releases_repeated"
    lost = _ledger(reference_dir) - _ledger(run_dir)
    assert not lost, f"{label}: ledger lines of the uninterrupted run missing after the resume: {list(lost)[:3]}"
    rounds = _metric_rounds(run_dir)
    assert sorted(rounds) == sorted(set(rounds)) == _metric_rounds(reference_dir), f"{label}: metrics.csv rounds {rounds}"
    left = [p.name for p in run_dir.rglob("*") if p.name.endswith(".tmp")]
    assert not left, f"{label}: temporary files left: {left}"


def _kill_and_resume(seed: int, reference: dict, tmp_path: Path) -> None:
    point, when, nth, sig = case(seed, reference["counts"])
    label = f"seed {seed}: {sig} {when} call {nth} of {point}"
    run_dir = tmp_path / "run"
    cut = _run([INJECT, point, when, str(nth), sig, "--", *_fit_args(run_dir)])
    # 143: SIGTERM handled (the round ends, a checkpoint); -9 SIGKILL; -15: SIGTERM before the handler is
    # installed (the run is still starting) or after it is given back (the run has ended)
    assert cut.returncode in (0, -9, -15, 143), f"{label}: exit {cut.returncode}\n{cut.stderr[-2000:]}"
    assert "Traceback" not in cut.stderr, f"{label}: {cut.stderr[-2000:]}"
    summary = run_dir / "summary.json"
    ended = summary.is_file() and json.loads(summary.read_text())["status"] in ("completed", "budget_spent")
    if cut.returncode == 143:
        assert json.loads(summary.read_text())["status"] == "interrupted", label
    if not ended:  # what the docs say for a run that did not end: the same command with --ckpt_path last
        done = _run(_fit_args(run_dir, "--ckpt_path", "last"))
        assert done.returncode == 0, f"{label}: the resume ended with {done.returncode}\n{done.stderr[-2000:]}"
    check_resumed_run(run_dir, reference["dir"], label)


@pytest.mark.slow
@pytest.mark.parametrize("seed", CI_SAMPLE)
def test_a_sample_of_process_faults_resumes_to_the_uninterrupted_run(seed, reference, tmp_path):
    _kill_and_resume(seed, reference, tmp_path)


@pytest.mark.slow
@pytest.mark.process_fuzz
@pytest.mark.parametrize("seed", [s for s in range(ALL_CASES) if s not in CI_SAMPLE])
def test_every_generated_process_fault_resumes_to_the_uninterrupted_run(seed, reference, tmp_path):
    _kill_and_resume(seed, reference, tmp_path)


def test_the_generator_reaches_every_point_signal_and_moment():
    """Over its seeds the generator draws every point, both signals, and the mid-write cut."""
    counts = {point: 5 for point in POINTS}
    drawn = [case(seed, counts) for seed in range(ALL_CASES)]
    assert {p for p, *_ in drawn} == set(POINTS)
    assert {s for *_, s in drawn} == {"KILL", "TERM"}
    assert ("checkpoint", "mid") in {(p, w) for p, w, *_ in drawn}
