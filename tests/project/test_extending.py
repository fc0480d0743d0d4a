"""The extension guide's examples (docs/extending.md) run in simulation and under Flower, with the same result.

One tiny DP-FedAvg run uses all three examples at once: the algorithm
(``examples.extending.myalgos.DecayingFedAvg``), the callback (``...mycallbacks.UploadNormLogger``)
and the model and client loss (``...mymodels.SmallCNN``, ``LabelSmoothingClient``). It runs in
simulation (``python -m fedfdp.fit``) and through the Flower server strategy and ClientApp over an
in-process grid; both give the same global model and the same logged upload norms. A run without
the decay gives a different model: the decay reaches the clients in both.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="the flower extra is not installed (pip install -e '.[flower]')")

from fedfdp.fit import main as fit_main  # noqa: E402
from fedfdp.flower.server_app import ServerSettings, run_server  # noqa: E402
from tests.flower_harness import CONFIGS, InProcessGrid, global_model, grid_nodes, max_relative_difference  # noqa: E402

EXAMPLES = "examples.extending"
EXTENDED = (f"--model.num_rounds 3 --model.eval_every 10 --wandb disabled "
            f"--model.algorithm {EXAMPLES}.myalgos.DecayingFedAvg --model.algorithm.init_args.decay 2.0 "
            f"--model.client {EXAMPLES}.mymodels.LabelSmoothingClient "
            f"--model.client.net {EXAMPLES}.mymodels.SmallCNN --model.client.net.num_classes 4 "
            f"--model.client.net.image_size 8 "
            f"--trainer.callbacks+={EXAMPLES}.mycallbacks.UploadNormLogger")


def _norms(run_dir: Path) -> list[float]:
    with open(run_dir / "metrics.csv") as f:
        return [float(r["upload_norm_mean"]) for r in csv.DictReader(f) if r.get("upload_norm_mean")]


@pytest.fixture(scope="module")
def simulated(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("sim") / "run"
    assert fit_main(["--config", str(CONFIGS["dpfedavg"]), *EXTENDED.split(), "--run_dir", str(run_dir)]) == 0
    return run_dir


@pytest.mark.slow
def test_examples_under_flower_equal_the_simulation(simulated, tmp_path):
    grid = InProcessGrid(grid_nodes(tmp_path / "ledgers"))
    settings = ServerSettings.from_run_config({"config": str(CONFIGS["dpfedavg"]), "overrides": EXTENDED,
                                               "run-dir": str(tmp_path / "flower")})
    deployed = run_server(grid, settings)  # type: ignore[arg-type]
    assert max_relative_difference(global_model(simulated), global_model(deployed)) == 0.0
    assert _norms(deployed) == _norms(simulated)


@pytest.mark.slow
def test_the_callback_logs_every_round_and_the_decay_changes_the_model(simulated, tmp_path):
    summary = json.loads((simulated / "summary.json").read_text())
    assert summary["algorithm"] == "DecayingFedAvg" and summary["rounds_run"] == 3
    saved = (simulated / "config.yaml").read_text()
    assert "SmallCNN" in saved and "LabelSmoothingClient" in saved and "UploadNormLogger" in saved
    norms = _norms(simulated)
    assert len(norms) == 3 and all(n > 0 for n in norms)
    undecayed = tmp_path / "undecayed"
    args = EXTENDED.replace("--model.algorithm.init_args.decay 2.0", "--model.algorithm.init_args.decay 0.0")
    assert fit_main(["--config", str(CONFIGS["dpfedavg"]), *args.split(), "--run_dir", str(undecayed)]) == 0
    assert max_relative_difference(global_model(simulated), global_model(undecayed)) > 1e-3
    # the decay shrinks every step after round 0: later uploads move the model less than without it
    assert _norms(simulated)[0] == pytest.approx(_norms(undecayed)[0], rel=1e-6)
    assert _norms(simulated)[2] < _norms(undecayed)[2]


def test_the_example_client_uses_its_own_loss():
    import torch

    from examples.extending.mymodels import LabelSmoothingClient, SmallCNN

    client = LabelSmoothingClient(net=SmallCNN(num_classes=4, image_size=8))
    output, target = torch.tensor([[10.0, 0.0, 0.0, 0.0]]), torch.tensor([0])
    plain = torch.nn.functional.cross_entropy(output, target, reduction="none")
    assert client.per_sample_loss(output, target).shape == (1,)
    assert client.per_sample_loss(output, target) > plain  # smoothing penalises a confident correct answer
