"""The start-up checks' collaborator of the accountant: refuse, before anything is charged, what no ε covers.

* :func:`check_delta`: δ ≥ 1/n (n the smallest client's training set) guarantees nothing for a record;
* :func:`check_population_delta`: δ ≥ 1/N guarantees nothing for a client of a population of N;
* :func:`guarantee_problem`: the first configured release, declared upload field or model layer whose
  guarantee would not hold (σ = 0, an unbounded clip, an undeclared upload field, BatchNorm, a model
  that failed its probe), or None.

The accounting callback runs them at ``setup_federation`` and tells the accountant the outcome
(:meth:`fedfdp.privacy.run_accountant.RunAccountant.record_start_checks`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from fedfdp.errors import ConfigError
from fedfdp.privacy.uploads import unprotected_declarations
from fedfdp.privacy.validation import DPRelease, check_releases, sample_mixing_layers

if TYPE_CHECKING:
    from torch import nn

__all__ = ["check_delta", "check_population_delta", "guarantee_problem"]


def check_delta(delta: float, train_sizes: Iterable[int]) -> None:
    """Refuse δ ≥ 1/n, n the smallest client's training set: releasing one random record of it
    outright is already (0, 1/n)-DP, so such a δ guarantees nothing (Dwork & Roth 2014, §2.3)."""
    sizes = [int(n) for n in train_sizes if int(n) > 0]
    if not sizes:
        return
    n = min(sizes)
    if not delta < 1.0 / n:
        raise ConfigError(f"RDPAccounting.delta={delta:g} guarantees nothing: it must be in (0, 1/n) with n = "
                          f"{n}, the smallest client's training set (1/n = {1.0 / n:.3g}); the papers use 1e-5")


def check_population_delta(delta: float, num_clients: int) -> None:
    """Refuse δ ≥ 1/N for a client-level mechanism over N clients (releasing one random client outright is
    already (0, 1/N)-DP)."""
    if not delta < 1.0 / num_clients:
        raise ConfigError(f"RDPAccounting.delta={delta:g} guarantees nothing for one client: it must be in "
                          f"(0, 1/N) with N = {num_clients}, the population (1/N = {1.0 / num_clients:.3g})")


def guarantee_problem(releases: Sequence[DPRelease], declared: dict[str, str | None], net: nn.Module,
                      algorithm: str, model_problems: Sequence[str] = ()) -> ConfigError | None:
    """The first reason the run's (ε, δ) claim would not hold, as the error that refuses it (None: it holds).

    Every configured release (``releases``: the algorithm's and the callbacks') must be noised and
    bounded, no layer of ``net`` may mix samples, the model must pass its probe (``model_problems``:
    :func:`fedfdp.privacy.probe.probe_client`'s findings) and every field of the uploads must be
    declared private (``declared``, :mod:`fedfdp.privacy.uploads`).
    """
    problems = unprotected_declarations(declared, releases)
    if problems:
        return ConfigError(
            f"model.algorithm {algorithm}: {problems[0]}, but trainer.callbacks "
            f"has callbacks.RDPAccounting, which would report an epsilon for the run; give the algorithm "
            f"its privacy mechanism (init_args.privacy: fedfdp.privacy.SampleLevelDP), or remove the DP callbacks, or set "
            f"RDPAccounting.allow_non_private: true to run it for analysis (epsilon inf, dp_valid false)")
    try:
        check_releases(releases)
    except ConfigError as err:
        return err
    mixing = sample_mixing_layers(net)
    if mixing:
        return ConfigError(
            f"model.client.init_args.net has layers that mix the samples of a batch ({', '.join(mixing)}: "
            f"BatchNorm), so one record moves the others' gradients and losses and no release is "
            f"differentially private; use GroupNorm/LayerNorm, or set "
            f"model.client.init_args.replace_batchnorm: true to replace them with GroupNorm")
    if model_problems:
        return ConfigError(model_problems[0])
    return None
