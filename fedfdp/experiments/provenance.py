"""What a planned run trains, and whether a run directory holds that run.

A harness plans a run as a config plus command-line overrides (a
:class:`~fedfdp.experiments.runner.RunSpec`). :func:`trained_config` resolves it into the config it
trains: the YAML, or what its ``make_config`` writes, with the seed and every ``--dotted.key value``
override applied, values read as YAML as jsonargparse reads them. This is a static reading of the
overrides, not jsonargparse's parse: an override of a class node (``--model.algorithm
fedfdp.algorithms.FedAvg``) sets its ``class_path`` and keeps its ``init_args``.

:func:`saved_config_differences` compares what a spec trains with the ``config.yaml`` a run saved,
so a harness never takes a run of another configuration for the one it asks for: the runner skips
finished runs, and an ``--override`` changed on the same ``--out`` used to be "skipped (finished)"
and tabulated with the old run's numbers. Used by :mod:`fedfdp.experiments.runner` (a finished
run's check) and :mod:`fedfdp.experiments.identity` (the rows of a table that are one run).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import yaml

from fedfdp import strict_yaml
from fedfdp.algorithms.retired import upgrade_config

from fedfdp.experiments.search_space import apply_overrides
from fedfdp.rundir import CONFIG_NAME, HARMLESS

__all__ = ["PlannedRun", "parse_overrides", "saved_config_differences", "trained_config"]


class PlannedRun(Protocol):
    """What :func:`trained_config` reads of a run's plan (:class:`fedfdp.experiments.runner.RunSpec`)."""

    run_dir: Path
    config: Path
    seed: int | None
    args: tuple[str, ...]
    make_config: Callable[[], Mapping[str, Any]] | None


def _value(text: str) -> Any:
    """One command-line value as jsonargparse reads it: YAML (true, null, 0.1, [1, 2]), and floats
    in exponent spelling (``1e-3``, a string to YAML 1.1)."""
    value = strict_yaml.load(text)
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


def _is_class_node(node: Any) -> bool:
    return isinstance(node, dict) and "class_path" in node


def _class_path_keys(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` as jsonargparse reads them on class nodes (mappings with ``class_path``): a class
    name given to the node is its ``<key>.class_path`` (``--model.algorithm <class>``), and an
    argument named directly under it is one of its ``init_args`` (``--model.algorithm.lr 0.1``)."""
    resolved = {}
    for key, value in overrides.items():
        node: Any = config
        parts: list[str] = []
        for part in key.split("."):
            if _is_class_node(node) and part not in ("class_path", "init_args", "dict_kwargs"):
                parts.append("init_args")
                node = node.get("init_args")
            parts.append(part)
            node = node.get(part) if isinstance(node, dict) else None
        is_class_node = _is_class_node(node) and isinstance(value, str)
        resolved[".".join(parts) + (".class_path" if is_class_node else "")] = value
    return resolved


def trained_config(spec: PlannedRun) -> dict[str, Any]:
    """The config ``spec`` trains: its YAML (``make_config``'s when it has one), its seed, its overrides."""
    base = spec.make_config() if spec.make_config is not None else strict_yaml.load(spec.config.read_text())
    config = apply_overrides(dict(base), {} if spec.seed is None else {"seed_everything": spec.seed})
    return apply_overrides(config, _class_path_keys(config, parse_overrides(spec.args)))


def _same_class(asked: str, saved: str) -> bool:
    """Whether two ``class_path`` spellings name one class (``fedfdp.algorithms.FedAvg`` and the
    module it is defined in; a bare class name, as jsonargparse accepts one, against its full path)."""
    def load(path: str) -> Any:
        module, _, name = path.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name) if module else None
        except (ImportError, AttributeError, ValueError):
            return None

    found = load(saved)
    return found is not None and (found is load(asked) or ("." not in asked and found.__name__ == asked))


def _same_value(asked: Any, saved: Any) -> bool:
    if asked == saved:
        return True
    if isinstance(asked, bool) or isinstance(saved, bool):
        return False
    try:  # a number the YAML file spells as a string (1e-5 is a string to YAML 1.1), as jsonargparse reads it
        return float(asked) == float(saved)
    except (TypeError, ValueError):
        return False


def _differences(asked: Any, saved: Any, path: str, out: list[str]) -> None:
    """Append ``"path: ..."`` for each value ``asked`` sets that ``saved`` holds otherwise. A key absent
    from ``saved`` is one its class does not take (jsonargparse drops a replaced class's arguments):
    nothing it trained. Lists of class nodes (callbacks) must have as many entries."""
    if path and any(path == h or path.startswith(h + ".") or path.startswith(h + "[") for h in HARMLESS):
        return
    if isinstance(asked, dict) and isinstance(saved, dict):
        if "class_path" in asked and "class_path" in saved and asked["class_path"] != saved["class_path"] \
                and not _same_class(str(asked["class_path"]), str(saved["class_path"])):
            out.append(f"{path}.class_path: the run trained {saved['class_path']}, asked {asked['class_path']}")
            return
        for key, value in asked.items():
            if key in saved and key != "class_path":
                _differences(value, saved[key], f"{path}.{key}" if path else str(key), out)
    elif isinstance(asked, list) and isinstance(saved, list) and any(isinstance(v, dict) for v in asked + saved):
        if len(asked) != len(saved):
            out.append(f"{path}: the run had {len(saved)} entries, asked {len(asked)}")
            return
        for k, (a, s) in enumerate(zip(asked, saved)):
            _differences(a, s, f"{path}[{k}]", out)
    elif not _same_value(asked, saved):
        out.append(f"{path}: the run trained {json.dumps(saved, default=str)}, asked {json.dumps(asked, default=str)}")


def saved_config_differences(spec: PlannedRun) -> list[str]:
    """What ``spec`` asks (:func:`trained_config`) that the run in ``spec.run_dir`` did not train, as
    ``"dotted.path: the run trained X, asked Y"``, against its saved ``config.yaml`` (the fit's resolved
    config). Empty when they agree or the run saved no config. Ignored: the keys a resume may change
    (:data:`fedfdp.rundir.HARMLESS`: logging, progress, where the data is read from) and keys the
    config leaves at their defaults (a default is what the run trained)."""
    saved_file = spec.run_dir / CONFIG_NAME
    if not saved_file.is_file():
        return []
    try:
        saved = strict_yaml.load(saved_file.read_text())
    except (OSError, yaml.YAMLError) as err:
        return [f"{CONFIG_NAME}: cannot be read ({' '.join(str(err).split())[:120]})"]
    if not isinstance(saved, dict):
        return [f"{CONFIG_NAME}: not a configuration (a YAML mapping)"]
    out: list[str] = []
    # both sides in today's spelling: a run saved before privacy= (fedfdp.algorithms.retired) trained the same
    _differences(upgrade_config(trained_config(spec)), upgrade_config(saved), "", out)
    return out
