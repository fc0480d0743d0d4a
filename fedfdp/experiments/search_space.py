"""The search space of the tune command: its file format, checks, and how a trial's values become
``fedfdp.fit`` overrides (see :mod:`fedfdp.experiments.tune` for the format).

A space maps dotted config keys to a distribution ``{type: float|int|categorical, ...}`` or a
fixed value; a categorical ``choices`` may be a mapping of named alternatives holding further
distributions. :func:`sample_overrides` draws one trial's values through Optuna's define-by-run
API; :func:`grid_space` turns an all-categorical space into :class:`optuna.samplers.GridSampler`'s
grid (``--sampler grid``).
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any

import yaml

from fedfdp import strict_yaml

VAL_KEY = "data.init_args.val_fraction"


class TuneError(ValueError):
    """A usage error of the tune command (reported as one ``error:`` line, exit status 2)."""


#: The default search space (see the module docstring for the format).

DEFAULT_SPACE_YAML = """\
# Search space of `python -m fedfdp.experiments tune` (dotted config keys, as on the fedfdp.fit
# command line). The default: a DP-SGD algorithm (FedFDP, DP-FedAvg) on FashionMNIST.
model.algorithm.init_args.lr: {type: float, low: 0.1, high: 10.0, log: true}             # local lr
model.algorithm.init_args.privacy.init_args.max_grad_norm: {type: float, low: 0.01, high: 1.0, log: true}  # C
model.algorithm.init_args.privacy.init_args.sample_rate: {type: float, low: 0.01, high: 0.2, log: true}    # q (rounds follow from eps)
model.algorithm.init_args.privacy.init_args.local_steps: {type: int, low: 1, high: 4}
model.ema_decay: {type: categorical, choices: [null, 0.9, 0.95, 0.99]}  # average of w_t (post-processing)
model.server_optimizer:
  type: categorical
  choices:
    sgd:   # lr 1 and momentum 0 is FedAvg's average
      class_path: torch.optim.SGD
      init_args: {lr: 1.0, momentum: {type: float, low: 0.0, high: 0.9}}
    adam:  # FedAdam
      class_path: torch.optim.Adam
      init_args: {lr: {type: float, low: 0.001, high: 0.1, log: true}}
"""
DEFAULT_SPACE: dict[str, Any] = yaml.safe_load(DEFAULT_SPACE_YAML)
_KEY = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


# ---- search space --------------------------------------------------------------------------------
def _is_distribution(spec: Any) -> bool:
    return isinstance(spec, dict) and spec.get("type") in ("float", "int", "categorical")


def _distribution(name: str, spec: dict[str, Any]) -> Any:
    """The Optuna distribution of a ``{type: ...}`` spec (TuneError naming ``name`` when it is bad)."""
    import optuna

    kind = spec["type"]
    allowed = {"float": {"type", "low", "high", "log", "step"}, "int": {"type", "low", "high", "log", "step"},
               "categorical": {"type", "choices"}}[kind]
    extra = sorted(set(spec) - allowed)
    if extra:
        raise TuneError(f"search space: {name}: unknown field(s) {', '.join(extra)} for type {kind} "
                        f"(accepted: {', '.join(sorted(allowed))})")
    try:
        if kind == "categorical":
            choices = spec.get("choices")
            if isinstance(choices, dict):
                if not choices:
                    raise ValueError("choices must not be empty")
                return optuna.distributions.CategoricalDistribution([str(k) for k in choices])
            if not isinstance(choices, list) or not choices:
                raise ValueError("choices must be a non-empty list or a mapping of named alternatives")
            return optuna.distributions.CategoricalDistribution(choices)
        if "low" not in spec or "high" not in spec:
            raise ValueError("low and high are required")
        cls = optuna.distributions.FloatDistribution if kind == "float" else optuna.distributions.IntDistribution
        args = {"low": spec["low"], "high": spec["high"], "log": bool(spec.get("log", False))}
        if "step" in spec:
            args["step"] = spec["step"]
        if kind == "int" and not all(isinstance(args[k], int) and not isinstance(args[k], bool)
                                     for k in ("low", "high")):
            raise ValueError("low and high must be integers")
        if kind == "float" and not all(isinstance(args[k], (int, float)) and not isinstance(args[k], bool)
                                       and math.isfinite(args[k]) for k in ("low", "high")):
            raise ValueError("low and high must be finite numbers")
        return cls(**args)
    except (ValueError, TypeError) as err:
        raise TuneError(f"search space: {name}: {' '.join(str(err).split())}") from err


def _check_nested(name: str, value: Any) -> None:
    """Validate every distribution inside a fixed value or a named alternative."""
    if _is_distribution(value):
        _distribution(name, value)
        if value["type"] == "categorical" and isinstance(value["choices"], dict):
            for choice, sub in value["choices"].items():
                _check_nested(f"{name}.{choice}", sub)
    elif isinstance(value, dict):
        for key, sub in value.items():
            _check_nested(f"{name}.{key}", sub)


def load_space(path: str | None) -> dict[str, Any]:
    """The search space of ``path`` (YAML or JSON), or :data:`DEFAULT_SPACE`; checked (TuneError)."""
    if path is None:
        space = copy.deepcopy(DEFAULT_SPACE)
    else:
        try:
            space = strict_yaml.load(Path(path).read_text())
        except (OSError, UnicodeDecodeError) as err:
            raise TuneError(f"--space {path} cannot be read ({' '.join(str(err).split())})") from err
        except yaml.YAMLError as err:
            raise TuneError(f"--space {path} is not valid YAML or JSON: {str(err).splitlines()[0]}") from err
        if not isinstance(space, dict) or not space:
            raise TuneError(f"--space {path} must hold a non-empty mapping of dotted config keys to distributions")
    for key, spec in space.items():
        if not isinstance(key, str) or not _KEY.match(key):
            raise TuneError(f"search space: {key!r} is not a dotted config key such as model.algorithm.init_args.lr")
        if key == VAL_KEY:
            raise TuneError(f"search space: {VAL_KEY} is set by --val-fraction (every trial must score on the same "
                            f"validation data); leave it out of the space")
        if key.startswith(("run_dir", "ckpt_path", "seed_everything", "config")):
            raise TuneError(f"search space: {key} is set by the tune command, not searched")
        _check_nested(key, spec)
    return space


def _resolve(trial: Any, name: str, value: Any) -> Any:
    """``value`` with every distribution inside replaced by the trial's suggestion (named by its path)."""
    if _is_distribution(value):
        kind = value["type"]
        if kind == "float":
            return trial.suggest_float(name, value["low"], value["high"], log=bool(value.get("log", False)),
                                       step=value.get("step"))
        if kind == "int":
            return trial.suggest_int(name, value["low"], value["high"], log=bool(value.get("log", False)),
                                     step=value.get("step", 1))
        choices = value["choices"]
        if isinstance(choices, dict):
            pick = trial.suggest_categorical(name, [str(k) for k in choices])
            return _resolve(trial, f"{name}.{pick}", choices[pick])
        return trial.suggest_categorical(name, choices)
    if isinstance(value, dict):
        return {k: _resolve(trial, f"{name}.{k}", v) for k, v in value.items()}
    return value


def sample_overrides(trial: Any, space: dict[str, Any]) -> dict[str, Any]:
    """One trial's values: dotted config key -> value (a class_path/init_args mapping for a choice)."""
    return {key: _resolve(trial, key, spec) for key, spec in space.items()}


def _get_dotted(config: dict[str, Any], key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def baseline_params(config: dict[str, Any], space: dict[str, Any]) -> dict[str, Any]:
    """The config's own values of the space's keys, as the trial parameters that reproduce them.

    A plain float/int/categorical key gives its value when it lies in the range (or the choices). A
    categorical of named alternatives (``choices: {sgd: {class_path: ..., init_args: {momentum:
    {type: float, ...}}}}``) gives the alternative whose fixed parts equal the config's node and the
    values of the distributions inside it (named as :func:`sample_overrides` names them), so a
    config's server optimizer is trial 0's too. A key the config leaves unset, or sets to something
    the space cannot produce, is left out (the sampler draws it).
    """
    params: dict[str, Any] = {}
    for key, spec in space.items():
        if not _is_distribution(spec):
            continue
        found = _match(key, spec, _get_dotted(config, key))
        if found is not None:
            params.update(found)
    return params


def _match(name: str, spec: Any, value: Any) -> dict[str, Any] | None:
    """The parameters under ``name`` with which ``spec`` resolves to ``value``; None when none can."""
    if _is_distribution(spec):
        if value is None or isinstance(value, bool):
            return None
        if spec["type"] == "categorical":
            choices = spec["choices"]
            if isinstance(choices, dict):
                for choice, sub in choices.items():
                    found = _match(f"{name}.{choice}", sub, value)
                    if found is not None:
                        return {name: str(choice), **found}
                return None
            return {name: value} if value in choices else None
        if not isinstance(value, (int, float)) or not spec["low"] <= value <= spec["high"]:
            return None
        if spec["type"] == "int" and not isinstance(value, int):
            return None
        return {name: value}
    if isinstance(spec, dict):
        if not isinstance(value, dict) or set(value) - set(spec):  # the override would drop the extra keys
            return None
        params: dict[str, Any] = {}
        for k, sub in spec.items():
            found = _match(f"{name}.{k}", sub, value.get(k))
            if found is None:
                return None
            params.update(found)
        return params
    return {} if spec == value else None


def apply_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a copy) with every dotted key of ``overrides`` set (a mapping replaces the node)."""
    config = copy.deepcopy(config)
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = copy.deepcopy(value)
    return config


def cli_value(value: Any) -> str:
    """``value`` as one ``fedfdp.fit`` command-line argument (YAML spelling: true/false/null, JSON lists)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def override_args(overrides: dict[str, Any]) -> list[str]:
    """``fedfdp.fit`` command-line options setting ``overrides`` (``--key value``; a class_path
    mapping becomes ``--key CLASS --key.arg value ...``, as jsonargparse reads it)."""
    args: list[str] = []
    for key, value in overrides.items():
        if isinstance(value, dict) and "class_path" in value:
            args += [f"--{key}", str(value["class_path"])]
            for arg, sub in (value.get("init_args") or {}).items():
                args += [f"--{key}.{arg}", cli_value(sub)]
        elif isinstance(value, dict) and value:
            args += override_args({f"{key}.{k}": v for k, v in value.items()})
        else:
            args += [f"--{key}", cli_value(value)]
    return args


def grid_space(space: dict[str, Any]) -> dict[str, list[Any]]:
    """Optuna's grid of a space whose every distribution is categorical (TuneError naming the key otherwise).

    Named alternatives (a mapping of choices) are grid points by name; they must hold fixed values only.
    """
    grid: dict[str, list[Any]] = {}
    for key, spec in space.items():
        if not _is_distribution(spec):
            continue
        choices = spec.get("choices")
        if spec["type"] != "categorical":
            raise TuneError(f"search space: {key}: --sampler grid needs categorical choices, got type {spec['type']}")
        if isinstance(choices, dict):
            for choice, sub in choices.items():
                if _contains_distribution(sub):
                    raise TuneError(f"search space: {key}.{choice}: --sampler grid needs fixed values inside a "
                                    f"named alternative")
            grid[key] = [str(k) for k in choices]
        else:
            grid[key] = list(choices)
    if not grid:
        raise TuneError("search space: --sampler grid needs at least one categorical choice")
    return grid


def _contains_distribution(value: Any) -> bool:
    if _is_distribution(value):
        return True
    return isinstance(value, dict) and any(_contains_distribution(v) for v in value.values())


def grid_size(space: dict[str, Any]) -> int:
    """Points of the grid of ``space``."""
    return math.prod(len(v) for v in grid_space(space).values())
