"""The privacy component: the mechanisms an algorithm is given, and what they rest on.

The mechanisms (``privacy=`` of an algorithm): :class:`SampleLevelDP` (DP-SGD in each client,
:mod:`fedfdp.privacy.sample_level`), :class:`EpochDPSGD` (DP-SGD by local epochs with a noise
multiplier per client, the clustered family's, :mod:`fedfdp.privacy.epoch_dpsgd`) and
:class:`ClientLevelDP` (each client hidden whole: clipped
updates, noise on their sum at the server, :mod:`fedfdp.privacy.client_level`). What they rest on: sampling, per-sample gradients, clip
rules, Gaussian releases, the probe, the channel checks, RDP accounting.

The run's accountant: :class:`PrivacyAccountant` (the interface, :mod:`fedfdp.privacy.accountant`),
implemented by :class:`fedfdp.privacy.run_accountant.RunAccountant` over the ledger
(:mod:`fedfdp.privacy.ledger`, :mod:`fedfdp.privacy.ledger_file`) and the round planning
(:mod:`fedfdp.privacy.planning`).
"""

from fedfdp.privacy.accountant import PrivacyAccountant, run_accountant_of
from fedfdp.privacy.accounting import OPACUS_DEFAULT_ORDERS, PAPER_ORDERS, DPEvent, PrivacyLedger, epsilon_of
from fedfdp.privacy.clipping import FairClip, FlatClip, fair_clip_factors, fairness_coefficients, flat_clip_factors
from fedfdp.privacy.planning import max_rounds
from fedfdp.privacy.client_level import ClientLevelDP
from fedfdp.privacy.epoch_dpsgd import EpochDPSGD
from fedfdp.privacy.sample_level import PrivacyMechanism, SampleLevelDP

__all__ = ["ClientLevelDP", "DPEvent", "EpochDPSGD", "FairClip", "FlatClip", "OPACUS_DEFAULT_ORDERS", "PAPER_ORDERS", "PrivacyAccountant", "PrivacyLedger", "PrivacyMechanism", "SampleLevelDP",
           "epsilon_of", "fair_clip_factors", "fairness_coefficients", "run_accountant_of", "flat_clip_factors",
           "max_rounds"]
