"""The moving average of the global weights (``model.ema_decay``): maths, use, checkpoints, privacy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from callbacks import FederationCallback, NoisyLossReporting, RDPAccounting
from fedfdp.algorithms import FedFDP
from fedfdp.errors import ConfigError
from fedfdp.fit import main
from fedfdp.privacy import SampleLevelDP
from tests.helpers import flat, run_federation, tiny_data
from tests.cli.test_cli import TINY


class GlobalWeights(FederationCallback):
    """Records ``w_t`` after every round (the server step is done before ``on_round_end``)."""

    def __init__(self) -> None:
        self.history: list[torch.Tensor] = []

    def on_round_end(self, trainer: Any, federation: Any, context: Any, updates: Any, metrics: Any) -> None:
        self.history.append(flat(federation.global_model).clone())


def _fedfdp() -> FedFDP:
    return FedFDP(fairness_weight=0.1, lr=1.0,
                  privacy=SampleLevelDP(sample_rate=0.3, max_grad_norm=1.0, noise_multiplier=1.0))


def _callbacks() -> list[Any]:
    return [NoisyLossReporting(loss_bound=2.5, noise_multiplier=5.0), RDPAccounting(target_epsilon=50.0, delta=1e-5)]


@pytest.mark.parametrize("decay", [0.0, 0.5, 0.9])
def test_released_model_is_the_exponential_average_of_the_global_models(decay):
    recorder = GlobalWeights()
    fed, _ = run_federation(_fedfdp(), [*_callbacks(), recorder], rounds=4, eval_every=2, ema_decay=decay)
    expected = recorder.history[0]
    for w in recorder.history[1:]:
        expected = decay * expected + (1 - decay) * w
    assert torch.allclose(flat(fed.released_model), expected, rtol=1e-6, atol=1e-7)
    assert fed.released_model is not fed.global_model
    # w_t itself keeps training: the average never feeds back into the rounds
    assert torch.equal(flat(fed.global_model), recorder.history[-1])
    if decay > 0:
        assert not torch.allclose(flat(fed.released_model), recorder.history[-1])


def test_average_changes_only_the_released_model_not_training_nor_epsilon():
    """Post-processing: same w_t, same DP events and ε with and without the average."""
    runs = [run_federation(_fedfdp(), _callbacks(), rounds=3, ema_decay=decay)[0] for decay in (None, 0.9)]
    plain, averaged = runs
    assert torch.equal(flat(plain.global_model), flat(averaged.global_model))
    eps = [next(cb for cb in f.federation_callbacks() if isinstance(cb, RDPAccounting)).epsilon() for f in runs]
    assert eps[0] == eps[1] and eps[0] > 0
    assert plain.released_model is plain.global_model
    # the evaluation reads the released model: its accuracy is that of the average
    assert plain.last_evaluation is not None and averaged.last_evaluation is not None
    assert not torch.equal(plain.last_evaluation.client_loss, averaged.last_evaluation.client_loss)


@pytest.mark.parametrize("decay", [1.0, -0.1, 2.0])
def test_decay_outside_zero_one_is_refused_naming_the_field(decay):
    with pytest.raises(ConfigError, match=r"model\.ema_decay must be in \[0, 1\) or null"):
        run_federation(_fedfdp(), _callbacks(), rounds=1, ema_decay=decay, data=tiny_data())


def _ckpt_average(run_dir: Path) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("global_ema.")}


@pytest.mark.slow
def test_average_is_checkpointed_and_a_resumed_run_continues_it_exactly(tmp_path):
    ema = ["--model.ema_decay", "0.8", "--wandb", "disabled"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["--config", TINY, "--run_dir", str(straight), "--model.num_rounds", "4", *ema]) == 0
    assert main(["--config", TINY, "--run_dir", str(split), "--model.num_rounds", "2", *ema]) == 0
    assert main(["--config", TINY, "--run_dir", str(split), "--model.num_rounds", "4", "--ckpt_path", "last",
                 *ema]) == 0
    a, b = _ckpt_average(straight), _ckpt_average(split)
    assert a and a.keys() == b.keys() and "global_ema.n_averaged" in a
    assert int(a["global_ema.n_averaged"]) == 4
    for key in a:
        assert torch.equal(a[key], b[key]), key
    summaries = [json.loads((d / "summary.json").read_text()) for d in (straight, split)]
    assert summaries[0]["final"]["accuracy"] == summaries[1]["final"]["accuracy"]


@pytest.mark.slow
def test_resume_with_another_decay_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["--config", TINY, "--run_dir", str(run_dir), "--model.ema_decay", "0.8", "--wandb", "disabled"]) == 0
    code = main(["--config", TINY, "--run_dir", str(run_dir), "--model.ema_decay", "0.5", "--model.num_rounds", "3",
                 "--ckpt_path", "last", "--wandb", "disabled"])
    assert code == 2
    assert "model.ema_decay" in capsys.readouterr().err
