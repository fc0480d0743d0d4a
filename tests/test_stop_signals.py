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
from tests.test_cli import TINY

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
