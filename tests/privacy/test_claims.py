"""Privacy claims that cannot be wrong: ``dp_valid`` and ``evaluated_models_private`` fail closed.

A run claims (ε, δ)-DP only when every field of every upload is declared private, covered by a
declared, checked release and charged; δ must be below 1/n; ε is never negative; and the run says
whether its ε covers the models it evaluates.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from callbacks import LossReporting, NoisyLossReporting, RDPAccounting
from callbacks.summary import privacy_claims
from fedfdp.algorithms import Algorithm, Ditto, FedAvg, FedFair, FedFDP
from fedfdp.errors import ConfigError, PrivacyError
from fedfdp.fit import main
from fedfdp.privacy.accounting import DPEvent, epsilon_of
from fedfdp.privacy.uploads import POST_PROCESSING, unprotected_fields
from fedfdp.types import LOSS_RELEASE, MODEL_RELEASE, ClientUpdate
from tests.helpers import private, run_federation, tiny_data
from tests.cli.test_cli import TINY

DP = {"lr": 0.5, "sample_rate": 0.2, "max_grad_norm": 1.0, "noise_multiplier": 1.0}


def _errors(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


# ---- 1. a non-private algorithm with DP callbacks is refused ---------------------------------------
def test_non_private_algorithm_with_dp_callbacks_is_refused_before_the_run_directory(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["--config", TINY, "--run_dir", str(run_dir), "--model.algorithm", "fedfdp.algorithms.FedAvg",
                 "--model.algorithm.init_args.lr", "0.05",
                 "--model.algorithm.init_args.privacy", "null"])
    err = _errors(capsys)
    assert code == 2 and len(err) == 1, err
    assert "FedAvg" in err[0] and "model update" in err[0] and "allow_non_private" in err[0]
    assert not run_dir.exists()


#: TINY's callbacks with allow_non_private; the loss release's rate given (a non-private algorithm has no
#: mechanism whose rate it could share)
_NON_PRIVATE_CALLBACKS = [
    {"class_path": "callbacks.NoisyLossReporting", "init_args": {"loss_bound": 2.5, "noise_multiplier": 5.0, "sample_rate": 0.2}},
    {"class_path": "callbacks.RDPAccounting",
     "init_args": {"target_epsilon": 10.0, "delta": 1.0e-5, "allow_non_private": True}}]


@pytest.mark.slow
def test_allow_non_private_runs_it_with_no_claim(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["--config", TINY, "--run_dir", str(run_dir), "--model.algorithm", "fedfdp.algorithms.FedAvg",
                 "--model.algorithm.init_args.lr", "0.05",
                 "--model.algorithm.init_args.privacy", "null", "--trainer.callbacks", json.dumps(_NON_PRIVATE_CALLBACKS)])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dp_valid"] is False and summary["evaluated_models_private"] is False
    assert math.isinf(summary["epsilon"])


class _Silent(Algorithm):
    """An algorithm that declares nothing (a user's new module): its uploads are not private."""

    def local_update(self, client, data, context, generator):  # noqa: D102 - never reached
        raise AssertionError("refused before training")


def test_an_algorithm_that_declares_nothing_is_not_private():
    with pytest.raises(ConfigError, match="_Silent: the model update leaves each client without clipping"):
        run_federation(_Silent(), [RDPAccounting(target_epsilon=5.0)])


# ---- 2. every upload field actually released must be covered ---------------------------------------
class _Smuggler(FedAvg):
    """DP-FedAvg that also uploads an undeclared statistic of its data."""

    def local_update(self, client, data, context, generator):  # noqa: D102
        update = super().local_update(client, data, context, generator)
        update.extras["label_counts"] = torch.bincount(data.y, minlength=4).float()
        return update


class _Uncharged(FedAvg):
    """DP-FedAvg that forgets to charge its model release."""

    def local_update(self, client, data, context, generator):  # noqa: D102
        update = super().local_update(client, data, context, generator)
        update.dp_events = []
        return update


class _Trace(RDPAccounting):
    """The accountant, recording which clients' releases reached the ledger."""

    charged: list[int] = []

    def on_client_release(self, trainer, federation, update):  # noqa: D102
        super().on_client_release(trainer, federation, update)
        self.charged.append(update.client_id)


@pytest.mark.parametrize(("algorithm", "message"), [
    (private(_Smuggler, **DP), r"carries extras\['label_counts'\]"),
    # the mechanism's receipts see it first: a release made and not charged
    (private(_Uncharged, **DP), r"made 1 private release\(s\) 'model' at sigma=1, q=0.2 that the upload does not charge")],
    ids=["undeclared-extra", "uncharged-model"])
def test_an_upload_with_an_unprotected_field_never_leaves(algorithm, message):
    accountant = _Trace()
    accountant.charged = []
    with pytest.raises(PrivacyError, match=r"round 1: client 0's upload " + message):
        run_federation(algorithm, [accountant])
    assert accountant.charged == []  # refused before it was charged, and so before it left


def test_unprotected_fields_checks_each_field_against_declaration_and_events():
    update = ClientUpdate(client_id=0, params=torch.zeros(2), num_examples=1, reported_loss=1.0,
                          extras={"delta_c": torch.zeros(2)})
    declared = {"params": MODEL_RELEASE, "reported_loss": LOSS_RELEASE, "extras.delta_c": POST_PROCESSING}
    assert len(unprotected_fields(update, declared)) == 2  # no event charged for params and loss
    update.dp_events = [(MODEL_RELEASE, DPEvent(noise_multiplier=1.0, sample_rate=0.1)), (LOSS_RELEASE, DPEvent(noise_multiplier=5.0, sample_rate=0.1))]
    assert unprotected_fields(update, declared) == []
    assert unprotected_fields(update, {**declared, "reported_loss": None}) == ["reported loss"]
    del declared["extras.delta_c"]
    assert unprotected_fields(update, declared) == ["extras['delta_c'] (declared by no component)"]


def test_exact_loss_reporting_with_a_dp_algorithm_is_refused():
    """FedFDP's model update is private, but an exact loss upload beside it is not."""
    with pytest.raises(ConfigError, match="reported loss leaves each client without clipping"):
        run_federation(private(FedAvg, **DP), [LossReporting(), RDPAccounting(target_epsilon=5.0)])


# ---- 3. δ and ε -------------------------------------------------------------------------------------
def test_delta_at_or_above_one_over_the_smallest_client_is_refused():
    data = tiny_data()
    data.setup("fit")
    n = min(int(s) for s in data.train_sizes)
    with pytest.raises(ConfigError, match=rf"delta=.* guarantees nothing: it must be in \(0, 1/n\) with n = {n}"):
        run_federation(private(FedAvg, **DP), [RDPAccounting(delta=1.0 / n)], data=tiny_data())
    fed, trainer = run_federation(private(FedAvg, **DP), [RDPAccounting(delta=0.99 / n)], rounds=1, data=tiny_data())
    assert privacy_claims(trainer, fed)["dp_valid"]


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(sigma=st.floats(0.3, 20.0), q=st.floats(0.001, 1.0), steps=st.integers(1, 2000),
       delta=st.floats(1e-12, 0.999))
def test_epsilon_is_never_negative(sigma, q, steps, delta):
    for accountant in ("rdp", "prv"):
        if accountant == "prv" and (steps > 200 or q < 0.01 or sigma < 0.5):
            continue  # PRV's discretisation is slow/ill-posed far out; the clamp is the same
        assert epsilon_of([DPEvent(noise_multiplier=sigma, sample_rate=q, steps=steps)], delta, accountant=accountant) >= 0.0


def test_prv_falls_back_to_the_rdp_bound_where_opacus_cannot_compute_it(caplog):
    """Found by the property test above: Opacus' PRV root finding fails at σ 7, q 1, δ 0.97. The
    RDP bound is reported instead (a valid guarantee), with a warning, rather than a crash."""
    from fedfdp.privacy.accounting import _prv_epsilon_cached

    _prv_epsilon_cached.cache_clear()  # the property test may have cached this composition already
    event = DPEvent(noise_multiplier=7.0, sample_rate=1.0, steps=1)
    with caplog.at_level("WARNING"):
        value = epsilon_of([event], 0.96875, accountant="prv")
    assert value == epsilon_of([event], 0.96875) >= 0.0
    assert "reporting the RDP bound" in caplog.text


# ---- 4. which models ε covers ---------------------------------------------------------------------
@pytest.mark.parametrize(("make", "callbacks", "dp_valid", "evaluated_private"), [
    (lambda: private(FedAvg, **DP), lambda: [RDPAccounting()], True, True),
    (lambda: private(FedFDP, **DP), lambda: [NoisyLossReporting(), RDPAccounting()], True, True),
    (lambda: private(Ditto, **DP, private_personal=True), lambda: [RDPAccounting()], True, True),
    (lambda: private(Ditto, **DP, private_personal=False, personal_lr=0.05), lambda: [RDPAccounting()], True, False),
    (lambda: FedAvg(lr=0.1), lambda: [], False, False),
    (lambda: FedFair(lr=0.1), lambda: [LossReporting()], False, False),
], ids=["dpfedavg", "fedfdp", "dp-ditto-private", "dp-ditto-personal-kept", "fedavg", "fedfair"])
def test_summary_claims(make, callbacks, dp_valid, evaluated_private):
    fed, trainer = run_federation(make(), callbacks(), rounds=1)
    claims = privacy_claims(trainer, fed)
    assert (claims["dp_valid"], claims["evaluated_models_private"]) == (dp_valid, evaluated_private)
    assert claims["epsilon_unit"] == ("record" if fed.accountant is not None else None)


class _PersonalKept(FedAvg):
    """DP-FedAvg that evaluates models it says nothing about (a user's new personalised module)."""

    def evaluation_groups(self, global_params, num_clients):  # noqa: D102
        return [([i], global_params.clone()) for i in range(num_clients)]


class _OffsetsFromRawData(FedAvg):
    """DP-FedAvg whose clients shift their logits by something it does not declare."""

    def evaluation_logit_offsets(self):  # noqa: D102
        return torch.zeros(3, 10)


class _DeclaredPersonal(_PersonalKept):
    """The same hook, vouched for by a declaration on the class that overrides it."""

    evaluated_models_covered = True


def test_an_overridden_evaluation_hook_without_a_declaration_is_not_covered():
    """Fail-closed: a declaration inherited from above the class that overrides an evaluation hook
    does not cover the new hook; the run stays DP, but ε no longer covers what it evaluates."""
    from fedfdp.algorithms import LocalOnly

    class _LocalSubclass(LocalOnly):  # private LocalOnly declares True for its own hook, not for this one
        def evaluation_groups(self, global_params, num_clients):  # noqa: D102
            return super().evaluation_groups(global_params, num_clients)

    for cls in (_PersonalKept, _OffsetsFromRawData):
        assert cls.evaluated_models_covered is True and cls.class_covers_evaluated_models() is False, cls
    # LocalOnly declares per run (with privacy: True), for its own hook only
    assert private(LocalOnly, **DP).covers_evaluated_models() is True
    local = private(_LocalSubclass, **DP)
    assert local.evaluated_models_covered is True and _LocalSubclass.class_covers_evaluated_models() is False
    assert local.covers_evaluated_models() is False
    assert _DeclaredPersonal.class_covers_evaluated_models() is True
    fed, trainer = run_federation(private(_PersonalKept, **DP), [RDPAccounting()], rounds=1)
    claims = privacy_claims(trainer, fed)
    assert (claims["dp_valid"], claims["evaluated_models_private"], claims["epsilon_unit"]) == (True, False, "record")


def test_every_algorithm_that_overrides_an_evaluation_hook_declares_what_it_covers():
    """The shipped algorithms' claims, from their declarations (DP-Ditto's depends on its flag)."""
    import fedfdp.algorithms as algorithms

    algorithms.load_all()
    # every shipped class declares on the class (a subclass overriding a hook loses it); LocalOnly and Ditto
    # then narrow it per run in covers_evaluated_models (private runs only; Ditto's personal models per flag)
    for name in algorithms.REGISTRY:
        cls = getattr(algorithms, name)
        if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
            continue
        assert cls.class_covers_evaluated_models() is True, name
    assert Ditto(personal_weight=0.1).covers_evaluated_models() is False  # non-private personal models
    assert private(Ditto, **DP, private_personal=True).covers_evaluated_models() is True
    assert private(Ditto, **DP, private_personal=False, personal_lr=0.05).covers_evaluated_models() is False
    from fedfdp.algorithms import LocalOnly

    assert private(LocalOnly, **DP).covers_evaluated_models() is True  # DP-SGD local models
    assert LocalOnly(lr=0.1).covers_evaluated_models() is False


@pytest.mark.slow
def test_summary_json_and_report_say_which_models_epsilon_covers(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["--config", TINY, "--run_dir", str(run_dir)]) == 0, capsys.readouterr().err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dp_valid"] is True and summary["evaluated_models_private"] is True
    assert summary["epsilon_unit"] == "record" and summary["privacy_mechanism"].startswith("record-level DP-SGD (q ")
    report = (run_dir / "report.md").read_text()
    assert "ε covers every release and every evaluated model" in report
    assert f"| ε unit | record: one record of any of the {summary['num_clients']} clients" in report
    plain = tmp_path / "plain"
    assert main(["--config", TINY, "--run_dir", str(plain), "--model.algorithm", "fedfdp.algorithms.FedAvg",
                 "--model.algorithm.init_args.privacy", "null",
                 "--trainer.callbacks", "[]"]) == 0, capsys.readouterr().err
    summary = json.loads((plain / "summary.json").read_text())
    assert summary["epsilon_unit"] is None and summary["privacy_mechanism"] is None and summary["dp_valid"] is False
    assert "ε unit" not in (plain / "report.md").read_text()


@pytest.mark.slow
def test_every_shipped_dp_config_declares_every_upload_private(tmp_path):
    """Every config with an accountant and no allow_non_private builds a run whose claims hold."""
    import yaml

    from fedfdp.cli.parser import build_cli

    repo = Path(__file__).resolve().parents[2]
    checked = 0
    for path in sorted((repo / "configs").rglob("*.yaml")):
        text = path.read_text()
        if "RDPAccounting" not in text or "allow_non_private: true" in text:
            continue
        config = yaml.safe_load(text)
        if config.get("data", {}).get("class_path", "").endswith(("CIFAR10DataModule", "HARDataModule")):
            continue  # data not available offline; their algorithms appear in FMNIST/MNIST configs too
        cli = build_cli(["--config", str(path), "--run_dir", str(tmp_path / "_".join(path.relative_to(repo).parts)), "--wandb", "disabled"])
        accountant = next(cb for cb in cli.trainer.callbacks if isinstance(cb, RDPAccounting))
        fed = cli.model
        fed.trainer = cli.trainer  # federation_callbacks() reads the trainer's callbacks
        from fedfdp.privacy.uploads import declared_upload_privacy, unprotected_declarations

        releases = list(fed.algorithm.dp_releases())
        for cb in [c for c in cli.trainer.callbacks if hasattr(c, "dp_releases")]:
            releases.extend(cb.dp_releases(fed))
        assert unprotected_declarations(declared_upload_privacy(fed), releases) == [], path
        assert accountant.allow_non_private is False
        checked += 1
    assert checked >= 20


def test_the_wandb_run_summary_gets_the_claims_and_status():
    from types import SimpleNamespace

    from lightning.pytorch.loggers import WandbLogger

    from callbacks.summary import _to_wandb_summary

    class _Logger(WandbLogger):
        def __init__(self) -> None:  # no W&B run: only its summary dictionary
            self.run = SimpleNamespace(summary={})

        @property
        def experiment(self):  # noqa: D102
            return self.run

    lg = _Logger()
    summary = {"status": "budget_spent", "dp_valid": True, "evaluated_models_private": False, "epsilon": 3.5,
               "rounds_run": 7, "final": {"accuracy": 0.9}}
    _to_wandb_summary(SimpleNamespace(loggers=[lg]), summary)
    assert lg.run.summary == {"status": "budget_spent", "dp_valid": True, "evaluated_models_private": False,
                              "epsilon": 3.5, "rounds_run": 7}
