"""What a harness run trains, and the rows of a table that are the same run under two names.

A harness row is a config plus command-line overrides; two rows can name the same training when an
override restates the config's own value (FinP's CNN DP config has β = 0.1, so its rows
``dpfinp_ala`` and ``dpfinp_ala_b0.1`` were one configuration run twice). :func:`trained_config`
resolves a :class:`~fedfdp.experiments.runner.RunSpec` into the config it trains (the YAML, or what
its ``make_config`` writes, with the seed and every ``--dotted.key value`` override applied, values
read as YAML as jsonargparse reads them), and :func:`distinct_rows` keeps the first row of each
configuration, so a table never shows one run as two methods nor spends the CPU twice.

This is a static reading of the overrides, not jsonargparse's parse: an override of a class node
(``--model.algorithm fedfdp.algorithms.FedAvg``) sets its ``class_path`` and keeps its
``init_args``. Two rows it calls distinct may still train alike (a default spelled out in one
config only); two it calls the same do train alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import yaml

from fedfdp.experiments.runner import RunSpec
from fedfdp.experiments.search_space import apply_overrides

K = TypeVar("K")


def _value(text: str) -> Any:
    """One command-line value as jsonargparse reads it: YAML (true, null, 0.1, [1, 2]), and floats
    in exponent spelling (``1e-3``, a string to YAML 1.1)."""
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def parse_overrides(args: Sequence[str]) -> dict[str, Any]:
    """``--key value`` and ``--key=value`` pairs of ``fedfdp.fit`` arguments as ``{dotted key: value}``;
    a flag followed by another option (or by nothing) is ``True``."""
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ValueError(f"expected an option at {arg!r} in {list(args)}")
        key, eq, text = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                text, i = args[i + 1], i + 1
            else:
                text = "true"
        overrides[key] = _value(text)
        i += 1
    return overrides


def _class_path_keys(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` with a class name given to a class node (a mapping with ``class_path``) turned
    into that node's ``<key>.class_path``, as jsonargparse reads ``--model.algorithm <class>``."""
    resolved = {}
    for key, value in overrides.items():
        node: Any = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        is_class_node = isinstance(node, dict) and "class_path" in node and isinstance(value, str)
        resolved[f"{key}.class_path" if is_class_node else key] = value
    return resolved


def trained_config(spec: RunSpec) -> dict[str, Any]:
    """The config ``spec`` trains: its YAML (``make_config``'s when it has one), its seed, its overrides."""
    base = spec.make_config() if spec.make_config is not None else yaml.safe_load(spec.config.read_text())
    config = apply_overrides(dict(base), {} if spec.seed is None else {"seed_everything": spec.seed})
    return apply_overrides(config, _class_path_keys(config, parse_overrides(spec.args)))


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
