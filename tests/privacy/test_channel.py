"""The only channel from a client to the server is its upload (fedfdp.privacy.channel).

The class: "the server half reads what the client half kept". The issue named one member (a
FedAvg subclass (run privately) that stores a client's raw mean label on ``self`` in ``local_update`` and writes
it into the global model in ``aggregate``); the others below were not listed: a list attribute
appended to in place, a tensor attribute changed in place, a numpy array written in place, a
field of a nested object, a stacked step's halves writing to ``self``, and the server's half
reading a client-state store. Each is refused before the upload is charged or aggregated.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from callbacks import RDPAccounting
from fedfdp.algorithms import FedAvg, Scaffold
from fedfdp.errors import PrivacyError
from fedfdp.privacy.channel import changed_attribute, fingerprint
from tests.helpers import RecordingAccountant as _Recorder, private, run_federation

DP = {"lr": 0.5, "sample_rate": 0.2, "max_grad_norm": 1.0, "noise_multiplier": 1.0}




class _StashedMean(FedAvg):
    """The issue's example: client 0's mean label kept on ``self``, written into the global model."""

    def local_update(self, client, data, context, generator):  # noqa: D102
        if data.client_id == 0:
            self.stash = float(data.y.float().mean())
        return super().local_update(client, data, context, generator)

    def aggregate(self, global_params, updates, context):  # noqa: D102
        target = super().aggregate(global_params, updates, context)
        target[0] = getattr(self, "stash", 0.0)
        return target


class _AppendedList(FedAvg):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen: list[float] = []

    def local_update(self, client, data, context, generator):  # noqa: D102
        self.seen.append(float(data.x.mean()))
        return super().local_update(client, data, context, generator)


class _TensorInPlace(FedAvg):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.total = torch.zeros(())

    def local_update(self, client, data, context, generator):  # noqa: D102
        self.total.add_(data.y.float().sum())
        return super().local_update(client, data, context, generator)


class _ArrayInPlace(FedAvg):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.counts = np.zeros(4)

    def local_update(self, client, data, context, generator):  # noqa: D102
        self.counts[int(data.y[0])] += 1
        return super().local_update(client, data, context, generator)


class _Notes:
    pass


_Notes.__module__ = "fedfdp.tests_notes"  # a fedfdp object: the fingerprint looks inside it


class _NestedField(FedAvg):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.notes = _Notes()

    def local_update(self, client, data, context, generator):  # noqa: D102
        self.notes.size = data.size
        return super().local_update(client, data, context, generator)


class _StackedHalves(FedAvg):
    """The stacked path: the step's batch half keeps the client's batch size on ``self``."""

    def stackable_step(self, context):  # noqa: D102
        spec = super().stackable_step(context)
        assert spec is not None
        batch = spec.batch

        def keep(data, generator):
            self.last_size = data.size
            return batch(data, generator)

        import dataclasses

        return dataclasses.replace(spec, batch=keep)


class _ServerReadsClientState(Scaffold):
    """The server's half reads client 0's control variate ``c_0`` (kept on the client)."""

    def aggregate(self, global_params, updates, context):  # noqa: D102
        self.client_state.get(0, "c")
        return super().aggregate(global_params, updates, context)


CASES = {
    "an attribute set (the issue's example)": (_StashedMean, "changed its attribute 'stash'"),
    "a list appended to": (_AppendedList, "changed its attribute 'seen'"),
    "a tensor changed in place": (_TensorInPlace, "changed its attribute 'total'"),
    "an array changed in place": (_ArrayInPlace, "changed its attribute 'counts'"),
    "a nested object's field": (_NestedField, "changed its attribute 'notes'"),
    "a stacked step's half": (_StackedHalves, "changed its attribute 'last_size'"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-client"])
def test_state_the_clients_half_leaves_for_the_server_is_refused_before_any_release(case, stacked):
    make, message = CASES[case]
    if case == "a stacked step's half" and not stacked:
        pytest.skip("the stacked halves run only in a stacked round")
    accountant = _Recorder()
    with pytest.raises(PrivacyError, match="the clients' half of model.algorithm") as err:
        run_federation(private(make, **DP), [accountant], stacked_round=stacked)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert accountant.charged == []  # refused before its ledger entry: nothing left the client


def test_the_servers_half_cannot_read_what_a_client_keeps():
    accountant = _Recorder()
    with pytest.raises(PrivacyError, match=r"server half \(aggregate\) read client 0's 'c'"):
        run_federation(private(_ServerReadsClientState, **DP), [accountant])


def test_allow_non_private_runs_it_with_epsilon_infinite():
    accountant = RDPAccounting(allow_non_private=True)
    run_federation(private(_StashedMean, **DP), [accountant])
    assert math.isinf(accountant.epsilon()) and not accountant.guarantee_holds


def test_a_plain_run_is_not_checked():
    class Plain(FedAvg):
        def local_update(self, client, data, context, generator):  # noqa: D102
            self.stash = data.size
            return super().local_update(client, data, context, generator)

    _, trainer = run_federation(Plain(lr=0.1), [], rounds=1)
    assert trainer.global_step == 1


def test_the_fingerprint_sees_each_kind_of_change_and_nothing_else():
    algorithm = private(FedAvg, **DP)
    algorithm.tensor, algorithm.array, algorithm.items = torch.zeros(2), np.zeros(2), {"a": [1.0, float("nan")]}
    before = fingerprint(algorithm)
    assert changed_attribute(algorithm, before) is None  # NaN equals itself
    algorithm.tensor.mul_(2)
    assert changed_attribute(algorithm, before) == "tensor"
    before = fingerprint(algorithm)
    algorithm.items["a"].append(2.0)
    assert changed_attribute(algorithm, before) == "items"
    before = fingerprint(algorithm)
    algorithm.array[0] = 1
    assert changed_attribute(algorithm, before) == "array"
    before = fingerprint(algorithm)
    del algorithm.tensor
    assert changed_attribute(algorithm, before) == "tensor"


class _ReadsDiagnostics(FedAvg):
    """Not listed: the server's half reads a simulation diagnostic (the raw mean training loss)."""

    seen: list[dict] = []

    def aggregate(self, global_params, updates, context):  # noqa: D102
        type(self).seen.extend(dict(u.diagnostics) for u in updates)
        return super().aggregate(global_params, updates, context)


def test_diagnostics_reach_the_logs_not_the_servers_half():
    from callbacks import FederationCallback

    class Metrics(FederationCallback):
        keys: set = set()

        def on_round_end(self, trainer, federation, context, updates, metrics):  # noqa: D102
            type(self).keys |= set(metrics)

    _ReadsDiagnostics.seen = []
    run_federation(private(_ReadsDiagnostics, **DP), [RDPAccounting(), Metrics()], rounds=1)
    assert _ReadsDiagnostics.seen == [{}, {}, {}]  # three clients, nothing but the releases
    assert {"client_train_loss", "client_batch_size"} <= Metrics.keys  # the logs still have them
