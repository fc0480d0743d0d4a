"""The README's extension example: a user model and a ClientModule subclass chosen from the command line."""

from __future__ import annotations

import json
import sys
import textwrap

from fedfdp.fit import main
from tests.test_cli import TINY

USER_MODULE = textwrap.dedent('''
    import torch.nn.functional as F
    from torch import nn
    from fedfdp import ClientModule

    class SmallCNN(nn.Module):
        def __init__(self, num_classes: int = 4):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                      nn.Linear(16 * 3 * 3, num_classes))
        def forward(self, x):
            return self.body(x)

    class LabelSmoothingClient(ClientModule):
        calls = 0
        def per_sample_loss(self, output, target):
            LabelSmoothingClient.calls += 1
            return F.cross_entropy(output, target, reduction="none", label_smoothing=0.1)
''')


def test_user_model_and_client_subclass_from_the_command_line(tmp_path, monkeypatch):
    (tmp_path / "mymodels_fedfdp_test.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    run_dir = tmp_path / "run"
    code = main(["--config", TINY, "--run_dir", str(run_dir),
                 "--model.client", "mymodels_fedfdp_test.LabelSmoothingClient",
                 "--model.client.net", "mymodels_fedfdp_test.SmallCNN"])
    assert code == 0
    assert sys.modules["mymodels_fedfdp_test"].LabelSmoothingClient.calls > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_run"] == 2
    assert "SmallCNN" in (run_dir / "config.yaml").read_text()


USER_ALGORITHM = textwrap.dedent('''
    from fedfdp.algorithms import DPFedAvg
    from fedfdp.types import RoundContext

    class DecayingDPFedAvg(DPFedAvg):
        """DP-FedAvg whose local learning rate decays as lr / (1 + decay * t)."""

        def __init__(self, *, decay: float = 0.01, **kwargs):
            super().__init__(**kwargs)
            self.decay, self.base_lr = decay, self.lr

        def configure_round(self, round_idx: int) -> RoundContext:
            self.lr = self.base_lr / (1 + self.decay * round_idx)
            return super().configure_round(round_idx)
''')


def test_user_algorithm_from_the_command_line(tmp_path, monkeypatch):
    (tmp_path / "myalgos_fedfdp_test.py").write_text(USER_ALGORITHM)
    monkeypatch.syspath_prepend(str(tmp_path))
    run_dir = tmp_path / "run"
    code = main(["--config", TINY, "--run_dir", str(run_dir), "--model.num_rounds", "3",
                 "--model.algorithm", "myalgos_fedfdp_test.DecayingDPFedAvg",
                 "--model.algorithm.init_args.decay", "0.5", "--model.algorithm.init_args.sample_rate", "0.2"])
    assert code == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["algorithm"] == "DecayingDPFedAvg" and summary["rounds_run"] == 3
    assert "decay: 0.5" in (run_dir / "config.yaml").read_text()
