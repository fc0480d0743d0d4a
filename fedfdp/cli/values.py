"""Checks that every number of a parsed configuration shares: one ``error:`` line naming the field.

Each class's own checks say what its options accept (``algorithm.sample_rate must be in (0, 1]``);
these run first, on the whole parsed configuration (every section, every ``init_args`` of every
class, every element of a list such as ``trainer.callbacks``), before anything is built, and
close what no option accepts:

* a real number must be finite (not NaN, not ±inf) and, unless 0, of a magnitude in
  [:data:`FLOAT32_TINY`, :data:`FLOAT32_MAX`]: the clients train in float32, where a larger
  value overflows and a smaller one is not a normal number;
* an integer must be at most :data:`INT_LIMIT` (2³¹ − 1) in magnitude: no count, size or
  period of a run can be larger (it could not be allocated or looped over);
* an iteration count (an option named ``*epochs``, ``*steps``, ``*iters`` or ``*rounds``) must
  be at most :data:`fedfdp.plan.MAX_ROUNDS` (10⁶): more plans a run that never ends;
* a seed (``seed_everything``, ``seed`` or ``*_seed``) must be an integer in numpy's seed range
  [0, :data:`SEED_MAX`] (``true`` for ``seed_everything``: a random seed).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from fedfdp.errors import ConfigError
from fedfdp.plan import MAX_ROUNDS

__all__ = ["FLOAT32_MAX", "FLOAT32_TINY", "INT_LIMIT", "SEED_MAX", "check_numbers", "check_value"]

FLOAT32_MAX = 3.4028234663852886e38
"""The largest finite float32."""
FLOAT32_TINY = 1.1754943508222875e-38
"""The smallest normal float32."""
INT_LIMIT = 2**31 - 1
"""The largest integer any option accepts (seeds excepted)."""
SEED_MAX = 2**32 - 1
"""The largest seed numpy accepts (and Lightning's ``seed_everything``)."""


def _leaves(value: Any, key: str) -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf of a nested mapping/list (list elements as ``key[i]``)."""
    if isinstance(value, Mapping):
        for name, item in value.items():
            yield from _leaves(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{key}[{i}]")
    else:
        yield key, value


_ITERATIONS = ("epochs", "steps", "iters", "rounds")


def _is_seed(key: str) -> bool:
    leaf = key.rsplit(".", 1)[-1].split("[")[0]
    return leaf in ("seed", "seed_everything") or leaf.endswith("_seed")


def check_value(key: str, value: Any) -> None:
    """Raise :class:`ConfigError` when ``value`` of option ``key`` breaks a shared rule (see the module)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if _is_seed(key):
        if not isinstance(value, int) or not 0 <= value <= SEED_MAX:
            raise ConfigError(f"{key} must be an integer in [0, {SEED_MAX}] (numpy's seed range), got {value!r}")
        return
    if isinstance(value, int):
        if abs(value) > INT_LIMIT:
            raise ConfigError(f"{key} must be an integer of magnitude at most {INT_LIMIT}, got {value}")
        if key.split("[")[0].rsplit(".", 1)[-1].endswith(_ITERATIONS) and value > MAX_ROUNDS:
            raise ConfigError(f"{key} must be at most {MAX_ROUNDS:,} (an iteration count; more plans a run that "
                              f"never ends), got {value:,}")
        return
    if not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value}")
    if value != 0 and not FLOAT32_TINY <= abs(value) <= FLOAT32_MAX:
        raise ConfigError(f"{key} must be 0 or of magnitude in [{FLOAT32_TINY:.4g}, {FLOAT32_MAX:.4g}] "
                          f"(the float32 range training runs in), got {value!r}")


def check_numbers(config: Mapping[str, Any]) -> None:
    """Apply :func:`check_value` to every leaf of ``config`` (a parsed configuration as a dict)."""
    for key, value in _leaves(config, ""):
        check_value(key, value)
