"""Evaluation cost cuts: the training-split schedule and the CPU evaluation batch size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from callbacks import FederationCallback
from fedfdp import FedAvg
from fedfdp.errors import ConfigError
from fedfdp.metrics import ACCELERATOR_EVAL_BATCH, CPU_EVAL_BATCH, eval_batch_size, evaluate_clientwise
from tests.helpers import TinyConvNet, run_federation


class Evaluations(FederationCallback):
    """Rounds of every evaluation, and of those that covered the training splits."""

    def __init__(self) -> None:
        self.rounds: list[int] = []
        self.train_rounds: list[int] = []

    def on_evaluate(self, trainer, federation, result, metrics):
        self.rounds.append(result.round)
        if "psi_train_global" in result.scalars:
            assert "train_accuracy" in result.scalars
            self.train_rounds.append(result.round)


@pytest.mark.parametrize(("rounds", "eval_every", "eval_train_every", "expected"), [
    (12, 1, 4, [4, 8, 9, 10, 11, 12]),  # every 4, and the last 5 evaluations
    (30, 2, None, [10, 20, 22, 24, 26, 28, 30]),  # default 5 * eval_every
    (7, 3, None, [3, 6, 7]),  # fewer rounds than the tail: every evaluation
])
def test_training_splits_are_evaluated_on_schedule(rounds, eval_every, eval_train_every, expected):
    evaluations = Evaluations()
    fed, _ = run_federation(FedAvg(lr=0.1, batch_size=64), [evaluations], rounds=rounds, eval_every=eval_every,
                            eval_train_every=eval_train_every)
    assert evaluations.train_rounds == expected
    assert evaluations.rounds[-1] == rounds and set(expected) <= set(evaluations.rounds)
    assert "psi_train_global" in fed.last_evaluation.scalars  # the final evaluation always has them


def test_no_training_splits_when_disabled():
    evaluations = Evaluations()
    run_federation(FedAvg(lr=0.1, batch_size=64), [evaluations], rounds=4, eval_every=2, eval_train_splits=False)
    assert evaluations.rounds == [2, 4] and evaluations.train_rounds == []


def test_eval_train_every_must_be_a_multiple_of_eval_every():
    from tests.helpers import tiny_client
    from fedfdp import Federation

    with pytest.raises(ConfigError, match="eval_train_every"):
        Federation(tiny_client(), FedAvg(lr=0.1), eval_every=10, eval_train_every=15)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target, reduction="none")


def test_evaluation_in_small_batches_equals_one_pass():
    torch.manual_seed(0)
    net = TinyConvNet()
    x, y, cid = torch.randn(300, 1, 8, 8), torch.randint(0, 4, (300,)), torch.randint(0, 3, (300,))
    default = evaluate_clientwise(net, _loss, x, y, cid, 3)  # CPU: batches of CPU_EVAL_BATCH
    whole = evaluate_clientwise(net, _loss, x, y, cid, 3, batch_size=300)
    for key in ("correct", "count", "loss_sum"):
        torch.testing.assert_close(default[key], whole[key])
    assert net.training  # the mode is restored


def test_eval_batch_size_defaults_by_device():
    assert eval_batch_size(None, torch.device("cpu")) == CPU_EVAL_BATCH
    assert eval_batch_size(None, torch.device("cuda")) == ACCELERATOR_EVAL_BATCH
    assert eval_batch_size(77, torch.device("cpu")) == 77
    fed, _ = run_federation(FedAvg(lr=0.1, batch_size=64), [], rounds=1)
    assert fed.eval_batch_size == CPU_EVAL_BATCH
