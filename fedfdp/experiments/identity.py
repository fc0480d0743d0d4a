"""The rows of a table that are the same run under two names.

A harness row is a config plus command-line overrides; two rows can name the same training when an
override restates the config's own value (FinP's CNN DP config has β = 0.1, so its rows
``dpfinp_ala`` and ``dpfinp_ala_b0.1`` were one configuration run twice). :func:`distinct_rows`
keeps the first row of each configuration (what each trains: :func:`fedfdp.experiments.provenance.trained_config`),
so a table never shows one run as two methods nor spends the CPU twice. Two rows it calls distinct
may still train alike (a default spelled out in one config only); two it calls the same do train alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from fedfdp.experiments.provenance import trained_config
from fedfdp.experiments.runner import RunSpec

__all__ = ["distinct_rows", "same_runs"]

K = TypeVar("K")


def distinct_rows(names: Sequence[K], spec_of: Callable[[K], RunSpec]) -> tuple[list[K], dict[K, K]]:
    """The rows of ``names`` that train a configuration no earlier row trains, and ``{dropped: the
    earlier row it repeats}``. ``spec_of(name)`` is the row's run for one seed (rows that agree on one
    seed agree on every seed: the seed is set alike in both)."""
    kept: list[K] = []
    configs: list[dict[str, Any]] = []
    same: dict[K, K] = {}
    for name in names:
        config = trained_config(spec_of(name))
        earlier = next((k for k, c in zip(kept, configs) if c == config), None)
        if earlier is None:
            kept.append(name)
            configs.append(config)
        else:
            same[name] = earlier
    return kept, same


def same_runs(specs: Mapping[K, RunSpec]) -> dict[K, K]:
    """``{key: an earlier key}`` for every spec of ``specs`` that trains what an earlier one trains."""
    return distinct_rows(list(specs), specs.__getitem__)[1]
