"""Checks of datamodule fields and loaded data: one clear error line naming the field or the file."""

from __future__ import annotations

import math

import numpy as np
from torch import Tensor

from fedfdp.errors import DataError, require

__all__ = ["check_fields", "check_finite", "is_int", "is_real"]


def is_int(value: object, minimum: int) -> bool:
    """Whether ``value`` is an integer ``>= minimum`` and not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= minimum


def is_real(value: object) -> bool:
    """Whether ``value`` is a finite real number and not a bool."""
    real = (int, float, np.integer, np.floating)
    return isinstance(value, real) and not isinstance(value, bool) and math.isfinite(value)


def check_finite(x: np.ndarray | Tensor, where: str, unit: str = "sample") -> None:
    """Raise DataError naming ``where`` when floating-point samples (``unit`` s: rows of ``x``) hold NaN or Inf.

    Integer data (``uint8`` images) cannot hold either; float data (HAR signals, float IDX files,
    a custom loader) must be caught at load, not blamed on the learning rate rounds later.
    """
    array = x.numpy() if isinstance(x, Tensor) else np.asarray(x)
    if not np.issubdtype(array.dtype, np.floating) or len(array) == 0:
        return
    finite = np.isfinite(array.reshape(len(array), -1)).all(axis=1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise DataError(f"{where}: NaN or Inf in {len(bad)} {unit}{'s' if len(bad) > 1 else ''} (first: {unit} "
                        f"{int(bad[0])}, counting from 0); expected finite numbers")


def check_fields(**checks: tuple[object, bool, str]) -> None:
    """Raise ConfigError ``"data.<field> must be <accepted>, got <value>"`` for the first failed check.

    Args:
        **checks: ``field=(value, ok, accepted)`` triples, checked in order.
    """
    for field, (value, ok, accepted) in checks.items():
        require(ok, f"data.{field} must be {accepted}, got {value!r}")
