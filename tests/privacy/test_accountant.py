"""The accountant's interface and its implementation, without Lightning or a federation."""

from __future__ import annotations

import inspect

import pytest

from callbacks import RDPAccounting
from fedfdp.errors import PrivacyBudgetError
from fedfdp.privacy.accountant import PrivacyAccountant, run_accountant_of
from fedfdp.privacy.accounting import DPEvent, epsilon_of
from fedfdp.privacy.run_accountant import RunAccountant
from fedfdp.types import LOSS_RELEASE, MODEL_RELEASE, ClientUpdate

STEP = DPEvent(noise_multiplier=2.0, sample_rate=0.05)
LOSS = DPEvent(noise_multiplier=5.0, sample_rate=0.05)


def _members(protocol: type) -> set[str]:
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return names


@pytest.mark.parametrize("cls", [RunAccountant, RDPAccounting])
def test_the_implementations_have_every_member_of_the_interface(cls):
    accountant = cls(target_epsilon=1.0)
    missing = [name for name in sorted(_members(PrivacyAccountant)) if not hasattr(accountant, name)]
    assert missing == []
    for name in _members(PrivacyAccountant):
        declared = inspect.getattr_static(PrivacyAccountant, name, None)
        if callable(declared):
            assert (list(inspect.signature(declared).parameters)
                    == list(inspect.signature(getattr(cls, name)).parameters)), name
    if cls is RDPAccounting:  # the callback hands itself over; an object that is no callback hands nothing
        assert run_accountant_of([object(), accountant]) is accountant


def test_the_interface_is_narrow_and_its_collaborators_are_apart():
    """The accountant's interface is the size of Flower's (compose, epsilon, would it exceed, state, settings);
    planning, the ledger file and the start-up checks are collaborators, not members."""
    members = _members(PrivacyAccountant)
    assert len(members) <= 10, sorted(members)
    assert {"compose", "epsilon", "would_exceed", "state_dict", "load_state_dict"} <= members
    assert not members & {"planned_rounds", "check_round", "open_ledger", "sync", "check_guarantee", "check_delta",
                          "is_privacy_accountant"}
    accountant = RunAccountant(target_epsilon=1.0)
    assert hasattr(accountant.budget, "planned_rounds") and hasattr(accountant.ledger, "open")


def test_would_exceed_says_whether_the_next_events_pass_the_budget():
    accountant = RunAccountant(target_epsilon=1.0)
    assert not accountant.would_exceed(0, [(MODEL_RELEASE, STEP)])
    assert accountant.would_exceed(0, [(MODEL_RELEASE, STEP.repeated(10_000))])
    assert not RunAccountant().would_exceed(0, [(MODEL_RELEASE, STEP.repeated(10_000))])  # no budget: never


def test_the_paper_setting_plans_683_rounds_and_refuses_the_684th(tmp_path):
    """FedFDP's default (σ 2, σ_l 5, q 0.05, ε 3.52, δ 1e-5, Theorem 2): 683 rounds, on 10 equal clients."""
    accountant = RunAccountant(target_epsilon=3.52, ledger_path=str(tmp_path / "ledger.jsonl"))
    accountant.ledger.open()
    accountant.declared_uploads = {"params": MODEL_RELEASE}  # what check_guarantee records at start
    planned = lambda cid: [(MODEL_RELEASE, STEP), (LOSS_RELEASE, LOSS)]  # noqa: E731
    assert accountant.budget.planned_rounds(10, planned, start_round=0) == 683
    for cid in range(2):
        accountant.charge_upload(0, ClientUpdate(client_id=cid, params=None, num_examples=1,  # type: ignore[arg-type]
                                                 dp_events=[(MODEL_RELEASE, STEP.repeated(682)),
                                                            (LOSS_RELEASE, LOSS.repeated(682))]))
    accountant.ledger.sync()
    assert accountant.budget.planned_rounds(10, planned, start_round=682) == 683  # one more round fits
    accountant.charge_upload(1, ClientUpdate(client_id=0, params=None, num_examples=1,  # type: ignore[arg-type]
                                             dp_events=planned(0)))
    with pytest.raises(PrivacyBudgetError, match="round 2 would spend epsilon=.* for client 0"):
        accountant.budget.check_round(2, [0, 1], planned)
    expected = epsilon_of([STEP.repeated(683), LOSS.repeated(683)], 1e-5)
    assert accountant.epsilon() == pytest.approx(expected) and accountant.client_epsilon(1) < expected
    accountant.ledger.close()

    again = RunAccountant(target_epsilon=3.52, ledger_path=str(tmp_path / "ledger.jsonl"))
    again.ledger.open()  # the ledger file is the source of truth
    assert again.epsilon() == accountant.epsilon() and again.state_dict() == accountant.state_dict()
    again.ledger.close()
