"""A refused resume changes no file: ``fedfdp.fit``, the Flower ServerApp and ClientApp, the experiment runner.

Each test snapshots the run directory (every file's name, size, mtime and bytes: ``dir_state``)
before a resume that is refused and compares it afterwards. Refusals come early (a resume that
changes the run: before the directory is locked) and late (nothing left to train: after the
checkpoint is restored, which used to migrate a checkpoint-only privacy ledger into a new
``privacy_ledger.jsonl``, the Flower server's case).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fedfdp.experiments import stop_signals
from fedfdp.experiments.runner import Runner, RunSpec, last_error_line
from fedfdp.fit import main
from fedfdp.runlock import RunLock
from tests.helpers import dir_state
from tests.cli.test_cli import TINY

ALG = "--model.algorithm.init_args."
PRIV = ALG + "privacy.init_args."  # the privacy mechanism's (fedfdp.privacy.SampleLevelDP) options


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-round simulation (copied by each test)."""
    run_dir = tmp_path_factory.mktemp("refused") / "run"
    assert main(["--config", TINY, "--run_dir", str(run_dir), "--wandb", "disabled"]) == 0
    return run_dir


@pytest.fixture()
def run(finished: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(finished, tmp_path / "run"))


def _errors(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


# ---- fedfdp.fit ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    ([PRIV + "noise_multiplier", "1.5"], "cannot resume"),  # refused before the directory is locked
    ([], "nothing left to train"),  # refused after the checkpoint is restored
])
def test_a_refused_resume_of_fit_changes_no_file(run, capsys, args, message):
    before = dir_state(run)
    assert main(["--config", TINY, "--run_dir", str(run), "--ckpt_path", "last", *args]) == 2
    (err,) = _errors(capsys)
    assert message in err
    assert dir_state(run) == before


@pytest.mark.slow
def test_a_refused_resume_does_not_write_a_checkpoint_only_ledger_and_an_accepted_one_does(run, capsys):
    """A run whose ledger is only in its checkpoint (as a Flower server's used to be): restoring it
    must not create privacy_ledger.jsonl before the resume is refused; a resume that trains does."""
    (run / "privacy_ledger.jsonl").unlink()
    before = dir_state(run)
    assert main(["--run_dir", str(run), "--ckpt_path", "last"]) == 2
    assert "nothing left to train" in _errors(capsys)[0]
    assert dir_state(run) == before
    assert main(["--run_dir", str(run), "--ckpt_path", "last", "--model.num_rounds", "3"]) == 0, _errors(capsys)
    rounds = [json.loads(line)["round"] for line in (run / "privacy_ledger.jsonl").read_text().splitlines()]
    assert rounds[0] == -1 and rounds[-1] == 2  # the migrated checkpoint entries, then round 3


@pytest.mark.slow
def test_a_refused_resume_with_wandb_writes_no_wandb_id(run, capsys, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    before = dir_state(run)
    assert main(["--run_dir", str(run), "--ckpt_path", "last", "--wandb", "offline"]) == 2
    assert "nothing left to train" in _errors(capsys)[0]
    assert dir_state(run) == before and not (run / "wandb").exists()


# ---- the Flower ServerApp and ClientApp ----------------------------------------------------------
@pytest.mark.slow
def test_a_refused_resume_of_the_flower_server_changes_no_file(tmp_path):
    pytest.importorskip("flwr")
    from fedfdp.errors import ConfigError, PrivacyBudgetError
    from fedfdp.flower.server_app import ServerSettings, run_server
    from tests.flower_harness import CONFIGS, OVERRIDES, InProcessGrid, grid_nodes

    ledgers, run_dir = tmp_path / "ledgers", tmp_path / "run"

    def serve(overrides: str, **extra: str) -> Path:
        settings = ServerSettings.from_run_config({"config": str(CONFIGS["dpscaffold"]), "overrides": overrides,
                                                   "run-dir": str(run_dir), **extra})
        return run_server(InProcessGrid(grid_nodes(ledgers)), settings)  # type: ignore[arg-type]

    serve(OVERRIDES)
    assert (run_dir / "privacy_ledger.jsonl").is_file()  # the server's view, written round by round
    before, nodes_before = dir_state(run_dir), dir_state(ledgers)
    with pytest.raises(PrivacyBudgetError, match="nothing left to train"):
        serve(OVERRIDES, **{"ckpt-path": "last"})
    with pytest.raises(ConfigError, match="cannot resume"):
        serve(OVERRIDES + f" {ALG}lr 0.5", **{"ckpt-path": "last"})
    assert dir_state(run_dir) == before and dir_state(ledgers) == nodes_before
    serve(OVERRIDES.replace("--model.num_rounds 3", "--model.num_rounds 4"), **{"ckpt-path": "last"})
    serve(OVERRIDES.replace("--model.num_rounds 3", "--model.num_rounds 5"), **{"ckpt-path": "last"})  # twice
    assert json.loads((run_dir / "summary.json").read_text())["rounds_run"] == 5


def test_a_client_that_refuses_a_round_changes_no_file(tmp_path):
    pytest.importorskip("flwr")
    from fedfdp.flower.node import NodeClient, NodeSettings
    from fedfdp.flower.node_state import ClientStateError
    from fedfdp.flower.protocol import ClientStateKey
    from tests.flower_harness import CONFIGS

    settings = NodeSettings.from_node_config({"partition-id": 0, "num-partitions": 3, "ledger-dir": str(tmp_path),
                                              "secure-rng": False, "target-epsilon": 3.0})
    node = NodeClient(CONFIGS["dpscaffold"].read_text(), settings, run="r")
    params = node.federation.client.get_flat_params().detach()
    assert not isinstance(node.train(params, 0, {}, {}, ClientStateKey("k", -1)), str)
    before = dir_state(tmp_path)
    with pytest.raises(ClientStateError, match="continues from its state after round 5"):  # a state it lacks
        node.train(params, 5, {}, {}, ClientStateKey("k", 4))
    node.ledger.target_epsilon = node.ledger.epsilon()  # the next round would exceed the client's own target
    assert "refuses" in node.train(params, 1, {}, {}, ClientStateKey("k", 0))
    node.close()
    assert dir_state(tmp_path) == before


# ---- the experiment runner -----------------------------------------------------------------------
class Fit:
    """Stands in for :func:`fedfdp.experiments.stop_signals.launch`: writes ``output``; with ``start`` it
    changes the run directory."""

    def __init__(self, code: int = 2, output: str = "error: cannot resume\n", start: bool = False) -> None:
        self.code, self.output, self.start, self.calls = code, output, start, []

    def __call__(self, cmd, stdout, stderr, env):
        self.calls.append(cmd)
        stdout.write(self.output)
        if self.start:
            run_dir = Path(cmd[cmd.index("--run_dir") + 1])
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(Path(cmd[cmd.index("--config") + 1]).read_text())
        return self.code


def _interrupted(run: Path) -> None:
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "status": "interrupted"}))


@pytest.mark.slow
def test_the_runner_changes_no_file_before_the_fit_starts(run, monkeypatch):
    """A resume whose fit refuses: the spec's new input_config.yaml, fit.log and harness.json stay out."""
    (run / "input_config.yaml").write_text("model: {num_rounds: 2}\n")
    (run / "fit.log").write_text("first session\n")
    _interrupted(run)
    spec = RunSpec(run_dir=run, config=run / "input_config.yaml", make_config=lambda: {"model": {"num_rounds": 3}})
    refusing = Fit()
    monkeypatch.setattr(stop_signals, "launch", refusing)
    before = dir_state(run)
    result = Runner().run(spec)
    assert result.status == "failed" and result.returncode == 2 and dir_state(run) == before
    assert not result.log.is_relative_to(run) and last_error_line(result.log) == "error: cannot resume"
    (cmd,) = refusing.calls
    assert cmd[cmd.index("--config") + 1] != str(spec.config) and cmd[-2:] == ["--ckpt_path", "last"]
    starting = Fit(code=0, output="training\n", start=True)
    monkeypatch.setattr(stop_signals, "launch", starting)
    assert Runner().run(spec).status == "ran"
    assert (run / "input_config.yaml").read_text() == "model:\n  num_rounds: 3\n"
    assert (run / "fit.log").read_text() == "first session\ntraining\n"
    assert json.loads((run / "harness.json").read_text())["command"][4] == str(spec.config)


def test_the_runner_leaves_a_busy_run_directory_and_puts_a_moved_run_back(run, tmp_path, monkeypatch):
    _interrupted(run)
    monkeypatch.setattr(stop_signals, "launch", Fit())
    lock = RunLock(run).acquire()
    before = dir_state(run)
    try:
        assert Runner().run(RunSpec(run_dir=run, config=Path(TINY))).status == "failed"
        assert dir_state(run) == before
    finally:
        lock.release()
    shutil.rmtree(run / "checkpoints")  # results without a checkpoint: moved aside, and back when the fit refuses
    before = dir_state(run)
    assert Runner().run(RunSpec(run_dir=run, config=Path(TINY))).status == "failed"
    assert dir_state(run) == before and not list(tmp_path.glob("run.stale-*"))
