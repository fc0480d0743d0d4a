"""Privacy maths: per-sample gradients, clip rules, Gaussian releases, RDP accounting, λ*, SIA metrics."""

from fedfdp.privacy.accounting import (OPACUS_DEFAULT_ORDERS, PAPER_ORDERS, DPEvent, PrivacyLedger, epsilon_of,
                                       max_rounds)
from fedfdp.privacy.clipping import FairClip, FlatClip, fair_clip_factors, fairness_coefficients, flat_clip_factors

__all__ = ["DPEvent", "FairClip", "FlatClip", "OPACUS_DEFAULT_ORDERS", "PAPER_ORDERS", "PrivacyLedger", "epsilon_of",
           "fair_clip_factors", "fairness_coefficients", "flat_clip_factors", "max_rounds"]
