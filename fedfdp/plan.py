"""Refuse a run whose plan is absurd before its first round: one line that gives the number.

The options each pass their own checks, but together they can plan a run that would never end
or would not mean anything. Checked when the federation is set up (and again once a checkpoint
is restored), before any file of the run is written:

* :func:`check_round_count`: more than :data:`MAX_ROUNDS` rounds planned, by ``model.num_rounds``
  or by the privacy budget (a noise multiplier so large that the budget allows astronomically
  many rounds);
* :func:`check_expected_batches`: a Poisson-sampled private release whose expected batch
  ``q·|D_i|`` is below one record for some client (its steps would mostly be noise on empty
  batches).

An ε the accountant cannot reach in one round is refused by ``callbacks.RDPAccounting`` with
the ε one round spends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedfdp.errors import ConfigError

if TYPE_CHECKING:
    from fedfdp.interfaces import FederationView

__all__ = ["MAX_ROUNDS", "check_expected_batches", "check_round_count"]

MAX_ROUNDS = 10**6
"""The most rounds a run may plan (a few days at a tenth of a second per round)."""


def check_round_count(total_rounds: int, num_rounds: int | None, budget_rounds: int | None) -> None:
    """Refuse ``total_rounds > MAX_ROUNDS``, naming what planned them.

    Args:
        total_rounds: the rounds planned (the smaller of ``num_rounds`` and the callbacks' limits).
        num_rounds: ``model.num_rounds`` (``None``: run to the budget).
        budget_rounds: the rounds the callbacks' limits (the privacy budget) allow, ``None`` if none
            (more than ``MAX_ROUNDS``: the accountant stops counting at ``MAX_ROUNDS + 1``).
    """
    if total_rounds <= MAX_ROUNDS:
        return
    if budget_rounds is not None and (num_rounds is None or budget_rounds <= num_rounds):
        raise ConfigError(f"the privacy budget allows more than {MAX_ROUNDS:,} rounds, the most a run may plan (is "
                          f"the noise multiplier or the target epsilon far too large?); set model.num_rounds to at "
                          f"most {MAX_ROUNDS:,}")
    raise ConfigError(f"model.num_rounds must be at most {MAX_ROUNDS:,}, got {num_rounds:,}")


def check_expected_batches(federation: FederationView) -> None:
    """Refuse a private release whose expected Poisson batch ``q·|D_i|`` is below one record for a client.

    Every Poisson-sampled event (``sample_rate < 1``) of every client's planned round is checked
    (:meth:`fedfdp.Federation.planned_dp_events`: the algorithm's and the callbacks' releases).
    """
    sizes = federation.datamodule.train_sizes
    checked: set[tuple[str, float, int]] = set()
    for cid in range(federation.num_clients):
        size = int(sizes[cid])
        for name, event in federation.planned_dp_events(cid):
            q = float(event.sample_rate)
            if q >= 1.0 or (name, q, size) in checked:
                continue
            checked.add((name, q, size))
            if q * size < 1.0:
                raise ConfigError(
                    f"the {name} release samples each record with probability q={q:.4g}: client {cid} "
                    f"({size} training records) then has an expected batch of q*|D_i|={q * size:.3g} records, "
                    f"below one; raise the algorithm's sample rate to at least {1.0 / max(size, 1):.4g} "
                    f"(or give the clients more data)")
