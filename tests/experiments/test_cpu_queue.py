"""``docs/complete_runs/cpu_queue.sh``: lanes share one queue, each job runs once, the lanes balance.

The harness commands are replaced by a stand-in that records its arguments (``CPU_QUEUE_EXP``),
and nothing is copied into ``docs/complete_runs`` (``CPU_QUEUE_KEEP=0``).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path

from tests.conftest import REPO

SCRIPT = REPO / "docs" / "complete_runs" / "cpu_queue.sh"


def _env(tmp_path: Path, job_seconds: str) -> dict[str, str]:
    # the stand-in: one line per job with the arguments as the harness would get them, then a short wait
    record = f"bash -c 'printf \"%s\\n\" \"$(printf \"%s|\" \"$@\")\" >> {tmp_path}/ran; sleep {job_seconds}' job"
    return {**os.environ, "CPU_QUEUE_LOG": str(tmp_path / "log"), "CPU_QUEUE_EXP": record, "CPU_QUEUE_KEEP": "0"}


def _jobs() -> list[str]:
    listed = subprocess.run(["bash", str(SCRIPT), "list"], capture_output=True, text=True, check=True).stdout
    return [line.strip().split("  ", 1)[1].split(" | ")[0] for line in listed.splitlines()]


def _wait_done(log: Path, lanes: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = [log / f"lane{n}.log" for n in range(1, lanes + 1)]
        if all(p.exists() and "the queue is done" in p.read_text() for p in logs):
            return
        time.sleep(0.1)
    raise AssertionError("the lanes did not finish: " + " / ".join(p.read_text() for p in log.glob("lane*.log")))


def test_two_lanes_run_every_job_once_and_share_the_queue(tmp_path):
    jobs = _jobs()
    assert len(jobs) == len(set(jobs)) >= 40 and any("local_nodp --seeds 2" in j for j in jobs)
    env = _env(tmp_path, "0.05")
    started = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    _wait_done(tmp_path / "log", 2)
    ran = (tmp_path / "ran").read_text().splitlines()
    # each job once, with its arguments as written (the quoted 'Dir(0.5)' is one argument)
    assert sorted(ran) == sorted("".join(f"{arg}|" for arg in shlex.split(job)) for job in jobs)
    assert any("|Dir(0.5)|Dir(1.0)|" in line for line in ran)
    taken = {n: (tmp_path / "log" / f"lane{n}.log").read_text().count(": job ") for n in (1, 2)}
    assert taken[1] + taken[2] == len(jobs) and min(taken.values()) > 0, taken


def test_a_second_start_while_lanes_run_is_refused_and_a_later_one_runs_the_queue_again(tmp_path):
    env = _env(tmp_path, "2")
    assert subprocess.run(["bash", str(SCRIPT)], env={**env, "LANES": "1"}, capture_output=True, timeout=60
                          ).returncode == 0
    again = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and again.stderr.startswith("error: a lane is running already"), again.stderr
    pid = int((tmp_path / "log" / "lane1.pid").read_text())
    os.killpg(os.getpgid(pid), 15)  # as `stop` does (without parking: nothing to park here)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    (tmp_path / "ran").unlink()
    env = _env(tmp_path, "0")
    assert subprocess.run(["bash", str(SCRIPT)], env={**env, "LANES": "1"}, capture_output=True, timeout=60
                          ).returncode == 0
    _wait_done(tmp_path / "log", 1)
    assert len((tmp_path / "ran").read_text().splitlines()) == len(_jobs())  # a new session's claims start empty
