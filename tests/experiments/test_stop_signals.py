"""A stop request never cuts a round, and a cut round is kept charged and said.

* :class:`callbacks.GracefulInterrupt` takes a repeat of the stop signal within
  ``REPEAT_WINDOW_S`` as the same request (a process group's signal and a harness's copy), a later
  one as "stop at once";
* :mod:`fedfdp.experiments.stop_signals` passes the first SIGINT/SIGTERM on to the running fit once,
  waits for it, and starts no further run;
* a harness stopped through its process group (as ``cpu_queue.sh stop`` and Ctrl-C do) leaves its
  fit checkpointed at a round boundary with nothing to replay, and the same command resumes it;
* a session cut mid-round (SIGKILL) leaves that round's releases charged; the resume says how many
  (``releases_repeated``) and the budget still holds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from callbacks.interrupt import REPEAT_WINDOW_S, GracefulInterrupt
from fedfdp.experiments import stop_signals
from fedfdp.experiments.stop_signals import HarnessInterrupted
from fedfdp.fit import main
from tests.conftest import REPO
from tests.cli.test_cli import TINY

ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}


def _default_stop_signals() -> None:
    """In the child: default dispositions (a pytest run as a background job passes SIGINT on as ignored)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _ledger(run_dir: Path) -> list[dict]:
    path = run_dir / "privacy_ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# ---- the fit: one request, however many copies ------------------------------------------------------
def test_a_repeat_within_the_window_is_the_same_request_and_a_later_one_stops_at_once():
    cb = GracefulInterrupt()
    cb._handle(signal.SIGTERM, None)
    cb._handle(signal.SIGTERM, None)  # the group's signal and the harness's copy: no exception
    cb._handle(signal.SIGINT, None)
    assert cb.signum == signal.SIGTERM
    cb._first_at -= REPEAT_WINDOW_S + 0.1  # the user asks again, later
    with pytest.raises(KeyboardInterrupt):
        cb._handle(signal.SIGTERM, None)


# ---- the harness: pass it on once, wait, start nothing more ----------------------------------------------
#: A child that counts the stop signals it gets, says it is ready, and exits 143 a second after the first.
CHILD = """
import signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
got = []
def handle(signum, frame):
    got.append(signal.Signals(signum).name)
    out.write_text("".join(g + "\\n" for g in got))
signal.signal(signal.SIGTERM, handle)
(out.parent / "ready").write_text("")
deadline = time.monotonic() + 60
while time.monotonic() < deadline and not got:
    time.sleep(0.01)
time.sleep(1.0)
sys.exit(143 if got else 0)
"""


def _signal_self_when_ready(ready: Path, sig: int) -> threading.Thread:
    def send() -> None:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), sig)
    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_launch_passes_the_signal_on_once_waits_for_the_fit_and_no_further_run_starts(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "got"
    with stop_signals.installed():
        sender = _signal_self_when_ready(tmp_path / "ready", signal.SIGTERM)
        code = stop_signals.launch([sys.executable, "-c", CHILD, str(out)])
        sender.join()
        assert code == 143  # the child ended on its own, a second after the signal: it was waited for
        assert out.read_text() == "SIGTERM\n"  # passed on exactly once
        with pytest.raises(HarnessInterrupted) as info:
            stop_signals.check()
        assert info.value.signum == signal.SIGTERM and "run the same command again" in str(info.value)
        (tmp_path / "ready").unlink()
        with pytest.raises(HarnessInterrupted):  # no further run starts
            stop_signals.launch([sys.executable, "-c", CHILD, str(tmp_path / "never")])
        assert not (tmp_path / "ready").exists()
    stop_signals.check()  # the outermost exit cleared the request
    assert signal.getsignal(signal.SIGTERM) == before


#: A harness of one long run (the runner every experiment command uses), exiting as the CLI does.
HARNESS = """
import logging, sys
from pathlib import Path
from fedfdp.experiments.runner import Runner, RunSpec
from fedfdp.experiments.stop_signals import HarnessInterrupted
logging.basicConfig(level=logging.INFO)
spec = RunSpec(run_dir=Path(sys.argv[1]), config=Path(sys.argv[2]), args=tuple(sys.argv[3:]))
try:
    result = Runner().run(spec)
except HarnessInterrupted as err:
    sys.exit(128 + err.signum)
sys.exit(result.returncode)
"""
ROUNDS = 60
LONG = ["--model.num_rounds", str(ROUNDS), "--model.eval_every", "20",
        "--trainer.callbacks.init_args.target_epsilon", "null"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_harness_stopped_through_its_process_group_leaves_no_round_cut_and_resumes(tmp_path, sig):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-c", HARNESS, str(run_dir), TINY, *LONG]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_stop_signals)
    deadline = time.monotonic() + 120
    while len({e["round"] for e in _ledger(run_dir)}) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    os.killpg(proc.pid, sig)  # the harness and its fit both get it, as from Ctrl-C or cpu_queue.sh stop
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + int(sig), stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped = summary["rounds_run"]
    assert summary["status"] == "interrupted" and 3 <= stopped < ROUNDS, stderr
    assert {e["round"] for e in _ledger(run_dir)} == set(range(stopped))  # the round ended: nothing to replay
    assert json.loads((run_dir / "harness.json").read_text())["returncode"] == 128 + int(sig)

    resumed = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_run"] == ROUNDS
    assert summary["releases_repeated"] == 0


# ---- a cut session: kept charged, and said -----------------------------------------------------------
@pytest.mark.slow
def test_a_session_cut_mid_round_keeps_its_releases_charged_and_the_resume_counts_them(tmp_path, capsys):
    budget = ["--model.num_rounds", "null", "--trainer.callbacks.init_args.target_epsilon", "5.0"]
    straight = tmp_path / "straight"
    assert main(["--config", TINY, "--run_dir", str(straight), *budget]) == 0
    whole = json.loads((straight / "summary.json").read_text())
    assert whole["status"] == "budget_spent" and whole["releases_repeated"] == 0 and whole["rounds_run"] >= 4

    cut = tmp_path / "cut"
    cmd = [sys.executable, "-m", "fedfdp.fit", "--config", TINY, "--run_dir", str(cut), *budget,
           "--trainer.callbacks+=tests.helpers.CutMidRound", "--trainer.callbacks.round", "2",
           "--trainer.callbacks.marker", str(tmp_path / "marker")]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 137, proc.stderr
    made_after_checkpoint = [e for e in _ledger(cut) if e["round"] >= 2]
    assert made_after_checkpoint and {e["client"] for e in made_after_checkpoint} == {0}

    capsys.readouterr()
    assert main(["--run_dir", str(cut), "--ckpt_path", "last"]) == 0
    err = capsys.readouterr().err
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["releases_repeated"] == len(made_after_checkpoint)
    assert f"holds {len(made_after_checkpoint)} releases made after the checkpoint (round 2)" in err, err
    # kept charged: client 0 has one round's releases more than the others, and the budget still holds
    ledger = _ledger(cut)
    per_client = {c: sum(1 for e in ledger if e["client"] == c) for c in {e["client"] for e in ledger}}
    assert per_client[0] == max(per_client.values()) > min(per_client.values())
    assert summary["status"] == "budget_spent" and summary["epsilon"] <= 5.0
    assert summary["rounds_run"] < whole["rounds_run"]  # the cost of the cut: the budget ends a round earlier
    report = (cut / "report.md").read_text()
    assert f"| releases charged twice (a session cut mid-round, made again on resume) | {len(made_after_checkpoint)} |" \
        in report
    assert "releases charged twice" not in (straight / "report.md").read_text()


# ---- the other doors: a sweep, a sweep under the runner, a study ----------------------------------------
def test_a_request_that_came_before_the_fit_started_is_kept_until_its_teardown():
    class Module:
        stop_signal = None

    cb = GracefulInterrupt()
    cb.signum = signal.SIGTERM  # a sweep passes it on to a run whose thread has not reached on_train_start
    cb.on_train_start(None, Module())
    try:
        assert cb.signum == signal.SIGTERM  # the run stops after its first round, not after its last
    finally:
        cb.teardown(None, Module(), "fit")
    assert cb.signum is None  # the next fit starts with no request


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_a_sweeps_stop_request_repeats_within_the_window_and_stops_at_once_later():
    from callbacks.interrupt import SweepStopRequest as _StopRequest

    class Interrupt:
        signum = None

    before = signal.getsignal(signal.SIGTERM)
    late = Interrupt()
    with _StopRequest() as stop:
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        os.kill(os.getpid(), signal.SIGTERM)  # before any run was built: kept
        os.kill(os.getpid(), signal.SIGTERM)  # the group's copy: the same request
        assert stop.signum == signal.SIGTERM
        stop.watch([late])  # runs built after the request get it
        assert late.signum == signal.SIGTERM
        stop._first_at -= REPEAT_WINDOW_S + 0.1
        with pytest.raises(KeyboardInterrupt):
            stop._handle(signal.SIGTERM, None)
    assert signal.getsignal(signal.SIGTERM) == before


class _SignalWhileBuilding:
    """Stands in for ``build_cli``: builds the run, and sends this process SIGTERM after the first."""

    def __init__(self, build) -> None:
        self.build, self.calls = build, 0

    def __call__(self, *args, **kwargs):
        cli = self.build(*args, **kwargs)
        self.calls += 1
        if self.calls == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return cli


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_a_sweep_stopped_while_its_runs_are_built_fits_none_and_the_runner_starts_nothing_more(tmp_path, monkeypatch):
    """The sweep's window before its runs fit (data, checkpoints: seconds) used to lose the signal:
    no handler of the sweep's yet, so it ran every round of every run (or Python's default killed it)."""
    import fedfdp.cli.parser as parser
    from fedfdp.experiments.runner import Runner, RunSpec

    monkeypatch.setattr(parser, "build_cli", _SignalWhileBuilding(parser.build_cli))
    specs = [RunSpec(run_dir=tmp_path / f"seed{seed}", config=Path(TINY), seed=seed, args=tuple(LONG))
             for seed in (0, 1)]
    with pytest.raises(HarnessInterrupted) as info:
        Runner().run_sweep(specs)
    assert info.value.signum == signal.SIGTERM
    for spec in specs:
        assert not _ledger(spec.run_dir) and not (spec.run_dir / "summary.json").exists()  # nothing released
    monkeypatch.undo()
    # the locks were given back and the handlers restored: the same sweep runs (capped short) to its end
    short = [RunSpec(run_dir=s.run_dir, config=s.config, seed=s.seed, args=("--model.num_rounds", "2")) for s in specs]
    results = Runner().run_sweep(short)
    assert [r.returncode for r in results] == [0, 0]
    assert all(json.loads((s.run_dir / "summary.json").read_text())["rounds_run"] == 2 for s in short)


TUNE_LONG = ["--rounds", str(ROUNDS), "--fit-args", "--model.eval_every", "20",
             "--trainer.callbacks.init_args.target_epsilon", "null"]


def _trial_states(study_dir: Path) -> dict[int, str]:
    import optuna

    study = optuna.load_study(study_name=study_dir.name, storage=f"sqlite:///{study_dir / 'study.db'}")
    return {t.number: t.state.name for t in study.trials}


@pytest.mark.slow
@pytest.mark.parametrize("how", [["--jobs", "2"], ["--batch", "2"]], ids=["fits", "sweep"])
def test_a_study_stopped_by_sigterm_to_it_alone_leaves_its_trials_running_and_resumable(tmp_path, how):
    """Before: tune held no handler (its fits ran on worker threads), so SIGTERM ended it at once and
    left its fits running unwatched (and a --batch sweep's stopped trials were recorded as failed)."""
    study = tmp_path / "study"
    space = tmp_path / "space.yaml"  # one-step DP-SGD trials: what the sweep engine batches, and valid for all values
    space.write_text('{"model.algorithm.init_args.lr": {"type": "float", "low": 0.2, "high": 2.0}}')
    cmd = [sys.executable, "-m", "fedfdp.experiments", "tune", "--config", TINY, "--study-dir", str(study),
           "--trials", "2", *how, "--space", str(space), *TUNE_LONG]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_stop_signals)
    trials = [study / "trial0", study / "trial1"]
    deadline = time.monotonic() + 180
    while (min(len({e["round"] for e in _ledger(t)}) for t in trials) < 3 and proc.poll() is None
           and time.monotonic() < deadline):
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    os.kill(proc.pid, signal.SIGTERM)  # the study alone, not its process group
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert [line for line in stderr.splitlines() if "error:" in line][-1].endswith("run the same command again to "
                                                                                    "resume"), stderr
    for trial in trials:
        summary = json.loads((trial / "summary.json").read_text())
        stopped = summary["rounds_run"]
        assert summary["status"] == "interrupted" and 3 <= stopped < ROUNDS, stderr
        assert {e["round"] for e in _ledger(trial)} == set(range(stopped))  # its round ended: nothing to replay
    assert _trial_states(study) == {0: "RUNNING", 1: "RUNNING"}  # not recorded as failed
    assert not (study / "trial2").exists()

    resumed = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert _trial_states(study) == {0: "COMPLETE", 1: "COMPLETE"}
    for trial in trials:
        summary = json.loads((trial / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["rounds_run"] == ROUNDS
        assert summary["releases_repeated"] == 0


@pytest.mark.slow
def test_a_trial_whose_fit_alone_is_stopped_stays_running_and_no_further_trial_starts(tmp_path):
    """A signal sent to a fit alone (a user's kill, a scheduler) stops it at a round boundary: resumable,
    so the harness stops as if it had got the signal (before: the trial was recorded as failed, for good)."""
    study = tmp_path / "study"
    space = tmp_path / "space.yaml"
    space.write_text('{"model.algorithm.init_args.lr": {"type": "float", "low": 0.2, "high": 2.0}}')
    cmd = [sys.executable, "-m", "fedfdp.experiments", "tune", "--config", TINY, "--study-dir", str(study),
           "--trials", "2", "--space", str(space), *TUNE_LONG]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_stop_signals)
    trial = study / "trial0"
    deadline = time.monotonic() + 180
    while len({e["round"] for e in _ledger(trial)}) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    os.kill(json.loads((trial / "run.lock").read_text())["pid"], signal.SIGTERM)  # the fit alone
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "sent to the fit, not to this harness" in stderr
    summary = json.loads((trial / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert {e["round"] for e in _ledger(trial)} == set(range(summary["rounds_run"]))
    assert _trial_states(study) == {0: "RUNNING"} and not (study / "trial1").exists()
