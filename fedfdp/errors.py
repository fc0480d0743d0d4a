"""Exceptions that the command line turns into one clear error line and a non-zero exit.

Every message names the offending field (or file) and what is accepted, for example
``"privacy.sample_rate must be in (0, 1], got 1.5"``. Library code raises these instead of
printing; :mod:`fedfdp.fit` catches :class:`FedFDPError` and exits with status 2.
"""

from __future__ import annotations


class FedFDPError(Exception):
    """Base class of every error that is the user's to fix (configuration or data)."""


class ConfigError(FedFDPError, ValueError):
    """A configuration value is outside its accepted range or inconsistent with another."""


class DataError(FedFDPError):
    """Dataset files are missing, truncated, corrupted or do not fit the configuration."""


class PrivacyBudgetError(FedFDPError):
    """Running (or resuming) would spend more than the configured privacy budget."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)


class PrivacyError(FedFDPError):
    """A release would leave a client without the guarantee the run claims."""


class DivergenceError(FedFDPError):
    """Training produced NaN or Inf (a loss or a model update)."""
