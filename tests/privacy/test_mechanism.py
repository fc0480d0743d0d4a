"""Releases carry proof of the mechanism (issue 36): an upload charges exactly what the private
mechanism did, and its private fields are the mechanism's outputs, or it never leaves the client.

One case per public method of ``Algorithm`` (and the loss-reporting callback) that can touch an
upload or a release: ``local_update``, ``stackable_step``, ``planned_dp_events``,
``upload_privacy``, ``fit_start_release`` / ``fit_start_events``, and ``NoisyLossReporting.on_client_update``.
``client_start_params`` (the start point: the broadcast or public server state),
``aggregate``/``on_round_end``/``evaluation_*`` (server side, after the release) and the
deployment state hooks (kept on the node, never uploaded) cannot change what a client uploads.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from callbacks import NoisyLossReporting, RDPAccounting
from fedfdp.algorithms import DPFedAvgAdaClip, DPFedAvgPriorCorrection, FedAvg, FedFDP
from fedfdp.errors import PrivacyError
from fedfdp.privacy.accounting import DPEvent
from fedfdp.privacy.mechanism import MechanismCall, joint_calls, tracing, unmatched
from fedfdp.privacy.release import gaussian_sum_release
from fedfdp.privacy.validation import DPRelease
from fedfdp.types import MODEL_RELEASE, LocalBatch, StackedStepSpec
from tests.helpers import RecordingAccountant as _Recorder, private, run_federation

DP = {"lr": 0.5, "sample_rate": 0.2, "max_grad_norm": 1.0, "noise_multiplier": 1.0}




# ---- subclasses that bypass the mechanism, one per hook -----------------------------------------------
class _PlainStep(FedAvg):
    """The issue's example: a plain SGD step, the parent's declarations and charges kept."""

    def local_update(self, client, data, context, generator):  # noqa: D102
        client.training_step(LocalBatch(x=data.x[:8], y=data.y[:8], lr=self.lr))
        return self.client_update(client, data, [])


class _ExtraStepAfter(FedAvg):
    """The private step, then an unnoised step on the same model before the upload is read."""

    def local_update(self, client, data, context, generator):  # noqa: D102
        rule = self.clip_rule(context)
        out = client.training_step(self.private_batch(data, rule, generator))
        client.training_step(LocalBatch(x=data.x[:8], y=data.y[:8], lr=self.lr))
        return self.client_update(client, data, [out])


class _EditedUpload(FedAvg):
    """The private step, then a data-dependent term added to the uploaded vector."""

    def local_update(self, client, data, context, generator):  # noqa: D102
        update = super().local_update(client, data, context, generator)
        update.params = update.params + 1e-3 * data.x.mean()
        return update


class _StackedEdit(FedAvg):
    """A stackable step whose upload half edits the model after the mechanism."""

    def stackable_step(self, context):  # noqa: D102
        spec = super().stackable_step(context)
        assert spec is not None

        def update(client, data, output):
            result = spec.update(client, data, output)
            result.params = result.params * 1.01
            return result
        return StackedStepSpec(batch=spec.batch, update=update, sample_rate=spec.sample_rate)


class _PlainStepBefore(FedAvg):
    """A plain full-batch SGD step, then DP-FedAvg's private step (the receipts once saw only that a
    private step happened)."""

    def local_update(self, client, data, context, generator):  # noqa: D102
        client.training_step(LocalBatch(x=data.x, y=data.y, lr=self.lr))
        return super().local_update(client, data, context, generator)


class _EditedBefore(FedAvg):
    """Not listed: a data-dependent term loaded into the model before the private step."""

    def local_update(self, client, data, context, generator):  # noqa: D102
        client.set_flat_params(client.get_flat_params() + 1e-3 * data.x.mean())
        return super().local_update(client, data, context, generator)


class _EveryRecord(FedAvg):
    """Trains on every record at every step but keeps the Poisson rate of its batches (q = 0.2)."""

    def private_batch(self, data, rule, generator):  # noqa: D102
        return dataclasses.replace(super().private_batch(data, rule, generator), x=data.x, y=data.y)


class _RepeatedRecords(FedAvg):
    """Not listed: a Poisson sample drawn from the client's records repeated 5 times (each record 5 chances)."""

    def private_batch(self, data, rule, generator):  # noqa: D102
        from fedfdp.types import ClientData

        repeated = ClientData(data.client_id, data.x.repeat(5, *[1] * (data.x.dim() - 1)), data.y.repeat(5))
        return super().private_batch(repeated, rule, generator)


class _TwoSamples(FedAvg):
    """Not listed: two honest Poisson samples joined into one batch (a rate of about 2q)."""

    def private_batch(self, data, rule, generator):  # noqa: D102
        first = super().private_batch(data, rule, generator)
        second = super().private_batch(data, rule, generator)
        return dataclasses.replace(first, x=torch.cat([first.x, second.x]), y=torch.cat([first.y, second.y]))


class _Undercharged(FedAvg):
    """Charges σ 10 times larger than its steps use (so ε reads 100 times smaller)."""

    def planned_dp_events(self, client_id, dataset_size):  # noqa: D102
        return [(MODEL_RELEASE, DPEvent(noise_multiplier=10 * self.privacy.noise_multiplier,
                                        sample_rate=self.privacy.sample_rate))]


class _WrongRate(FedAvg):
    """Charges its events at a tenth of the Poisson rate its batches are drawn at."""

    def planned_dp_events(self, client_id, dataset_size):  # noqa: D102
        return [(MODEL_RELEASE, DPEvent(noise_multiplier=self.privacy.noise_multiplier,
                                        sample_rate=self.privacy.sample_rate / 10))]


class _DeclaredFedAvg(FedAvg):
    """A non-private algorithm that declares its plain model private and charges for it."""

    def __init__(self):
        super().__init__(lr=0.1, local_mode="poisson_batch", sample_rate=0.2)

    def upload_privacy(self):  # noqa: D102
        return {"params": MODEL_RELEASE}

    def dp_releases(self):  # noqa: D102
        return [DPRelease(name="model update", noise_field="n/a", noise_multiplier=1.0, bound_field="n/a",
                          clip_bound=1.0)]

    def planned_dp_events(self, client_id, dataset_size):  # noqa: D102
        return [(MODEL_RELEASE, DPEvent(noise_multiplier=1.0, sample_rate=0.2))]

    def local_update(self, client, data, context, generator):  # noqa: D102
        update = super().local_update(client, data, context, generator)
        update.dp_events = self.planned_dp_events(data.client_id, data.size)
        return update


class _ExactHistogram(DPFedAvgPriorCorrection):
    """Charges the label histogram but hands over the exact counts."""

    def fit_start_release(self, federation, client_id):  # noqa: D102
        _, y = federation.datamodule.client_train(client_id)
        return {"noisy_counts": torch.bincount(y.long().cpu(), minlength=federation.datamodule.num_classes).double()}


class _FreeHistogram(DPFedAvgPriorCorrection):
    """Makes the noisy histogram release but charges nothing for it."""

    def fit_start_events(self, client_id):  # noqa: D102
        return []


class _RawLoss(NoisyLossReporting):
    """FedFDP's loss release, then the exact loss put in its place."""

    def on_client_update(self, trainer, federation, client, data, update):  # noqa: D102
        super().on_client_update(trainer, federation, client, data, update)
        update.reported_loss = float(client.per_sample_loss(client(data.x), data.y).mean())


CASES = {
    "local_update: plain step": (lambda: private(_PlainStep, **DP), [], "charges 1 DP event(s) 'model' at sigma=1, q=0.2 that "
                                                               "the private mechanism did not make"),
    "local_update: step after the mechanism": (lambda: private(_ExtraStepAfter, **DP), [],
                                               "uploads a model update that is not the model state after its last "
                                               "private step"),
    "local_update: upload edited": (lambda: private(_EditedUpload, **DP), [], "not the model state after its last private"),
    "stackable_step: upload edited": (lambda: private(_StackedEdit, **DP), [], "not the model state after its last private"),
    "local_update: plain step before the mechanism": (lambda: private(_PlainStepBefore, **DP), [],
                                                      "not the model state after its last private step"),
    "local_update: model edited before the mechanism": (lambda: private(_EditedBefore, **DP), [],
                                                        "not the model state after its last private step"),
    "private_batch: every record, q declared": (lambda: private(_EveryRecord, **DP), [],
                                                "charges 1 DP event(s) 'model' at sigma=1, q=0.2 that the private "
                                                "mechanism did not make"),
    "private_batch: records repeated": (lambda: private(_RepeatedRecords, **DP), [],
                                        "charges 1 DP event(s) 'model' at sigma=1, q=0.2 that the private mechanism "
                                        "did not make"),
    "private_batch: two samples joined": (lambda: private(_TwoSamples, **DP), [],
                                          "charges 1 DP event(s) 'model' at sigma=1, q=0.2 that the private mechanism "
                                          "did not make"),
    "planned_dp_events: sigma undercharged": (lambda: private(_Undercharged, **DP), [],
                                              "charges 1 DP event(s) 'model' at sigma=10, q=0.2"),
    "planned_dp_events: wrong q": (lambda: private(_WrongRate, **DP), [], "charges 1 DP event(s) 'model' at sigma=1, q=0.02"),
    "upload_privacy: plain model declared private": (_DeclaredFedAvg, [], "that the private mechanism did not make"),
    "fit_start_release: exact counts": (lambda: private(_ExactHistogram, prior_noise_multiplier=3.0, **DP), [],
                                        "charges 1 DP event(s) 'label_histogram' at sigma=3, q=1 that the private "
                                        "mechanism did not make"),
    "fit_start_events: release not charged": (lambda: private(_FreeHistogram, prior_noise_multiplier=3.0, **DP), [],
                                              "made 1 private release(s) 'label_histogram' at sigma=3, q=1 that it "
                                              "does not charge"),
    "on_client_update: exact loss": (lambda: private(FedFDP, fairness_weight=0.1, **DP), [_RawLoss(loss_bound=2.5)],
                                     "uploads a reported loss that the loss release did not return"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_upload_the_mechanism_did_not_make_never_leaves(case):
    make_algorithm, extra_callbacks, message = CASES[case]
    accountant = _Recorder()
    with pytest.raises(PrivacyError, match=r"upload|one-off release") as err:
        run_federation(make_algorithm(), [*extra_callbacks, accountant])
    assert message in str(err.value), str(err.value)
    assert accountant.charged == []  # refused before the ledger was written: nothing left the client
    assert "\n" not in str(err.value)


def test_allow_non_private_runs_a_bypass_with_infinite_epsilon():
    accountant = RDPAccounting(allow_non_private=True)
    run_federation(private(_PlainStep, **DP), [accountant])
    assert math.isinf(accountant.epsilon()) and not accountant.guarantee_holds


@pytest.mark.parametrize("make", [
    lambda: private(FedAvg, **DP), lambda: private(FedAvg, local_steps=3, **DP),
    lambda: private(FedFDP, fairness_weight=0.5, **DP),
    lambda: private(DPFedAvgAdaClip, count_noise_std=1.0, **{**DP, "noise_multiplier": 1.0}),
    lambda: private(DPFedAvgAdaClip, count_noise_std=1.0, count_accounting="separate", **DP),
    lambda: private(DPFedAvgPriorCorrection, prior_noise_multiplier=3.0, **DP)],
    ids=["dpfedavg", "three-steps", "fedfdp", "adaclip-split", "adaclip-separate", "prior"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-client"])
def test_the_shipped_algorithms_pass_their_own_receipts(make, stacked):
    callbacks = [NoisyLossReporting(loss_bound=2.5)] if "FedFDP" in type(make()).__name__ else []
    accountant = _Recorder()
    run_federation(make(), [*callbacks, accountant], stacked_round=stacked)
    assert accountant.charged and accountant.guarantee_holds


def test_calls_of_one_kind_on_one_sample_are_one_joint_mechanism():
    batch, other = object(), object()
    calls = [MechanismCall("model", 2.0, 0.1, batch), MechanismCall("model", 2.0, 0.1, batch),
             MechanismCall("model", 2.0, 0.1, other), MechanismCall("loss", 5.0, 0.1, batch)]
    joint = sorted(joint_calls(calls), key=lambda entry: (entry[0], entry[1]))
    assert [(kind, round(sigma, 12), q) for kind, sigma, q in joint] == [
        ("loss", 5.0, 0.1), ("model", round(2.0 / math.sqrt(2), 12), 0.1), ("model", 2.0, 0.1)]


def test_receipts_match_steps_one_to_one():
    """k charged steps need k calls; the multiset difference names what is left over either way."""
    with tracing(0) as trace:
        for _ in range(3):
            gaussian_sum_release([torch.zeros(3)], noise_multiplier=2.0, sensitivity=1.0, generator=torch.Generator(),
                                 kind=MODEL_RELEASE, sample_rate=0.5, sample=object())
    event = DPEvent(noise_multiplier=2.0, sample_rate=0.5, steps=3)
    assert unmatched([(MODEL_RELEASE, event)], trace) == ([], [])
    missing, extra = unmatched([(MODEL_RELEASE, dataclasses.replace(event, steps=4))], trace)
    assert len(missing) == 1 and extra == []
    missing, extra = unmatched([(MODEL_RELEASE, dataclasses.replace(event, steps=2))], trace)
    assert missing == [] and len(extra) == 1


def test_outside_a_trace_the_mechanism_records_nothing():
    out = gaussian_sum_release([torch.zeros(2)], noise_multiplier=1.0, sensitivity=1.0, generator=torch.Generator(),
                               kind=MODEL_RELEASE, sample_rate=0.1, sample=object())
    assert out[0].shape == (2,)


def test_a_one_off_release_must_hand_over_the_mechanism_output():
    from fedfdp.privacy.mechanism import verify_one_off_release
    from fedfdp.privacy.release import noisy_histogram_release

    counts = torch.tensor([3.0, 0.0, 5.0], dtype=torch.float64)
    with tracing(0) as trace:
        noisy = noisy_histogram_release(counts, noise_multiplier=2.0, generator=torch.Generator().manual_seed(0),
                                        kind="label_histogram")
    events = [("label_histogram", DPEvent(noise_multiplier=2.0, sample_rate=1.0))]
    assert verify_one_off_release(events, trace, {"noisy_counts": noisy}) == []
    assert verify_one_off_release(events, trace, {"noisy_counts": noisy.clone()}) == []  # equal values
    problems = verify_one_off_release(events, trace, {"noisy_counts": counts})
    assert problems == ["hands over 'noisy_counts', which no release of the mechanism returned"]
