"""One copy of a dataset for every run of a sweep that reads it (:mod:`fedfdp.sweep`).

A sweep holds ``R`` runs in one process, each with its own datamodule. Runs that differ only in
seeds and hyper-parameters load, partition and (with ScatterNet features) transform the same
data, so inside :func:`shared_setups` the first datamodule to set up keeps its result under a key
of everything that determines it (its class and every public setting, the feature extractor's
description included) and the others with the same key take that result: the same read-only
tensors, no second copy (ScatterNet features of FashionMNIST are 1.1 GB). Outside it, every
datamodule sets itself up alone, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["setup_key", "shared_setup", "shared_setups"]

#: What a setup produces (the attributes that :func:`shared_setup` shares).
SETUP_STATE = ("_store", "_val_store", "_indices", "_val_indices", "train_sizes", "test_sizes", "val_sizes",
               "_input_shape")

_LOCK = threading.Lock()
_SHARED: dict[str, dict[str, Any]] | None = None


@contextmanager
def shared_setups() -> Iterator[None]:
    """Within this context, datamodules with equal settings share one setup (and its tensors)."""
    global _SHARED
    previous = _SHARED
    _SHARED = {} if previous is None else previous
    try:
        yield
    finally:
        _SHARED = previous


def setup_key(datamodule: Any) -> str:
    """Everything that determines a datamodule's setup: its class and its public settings."""
    settings = {}
    for name, value in sorted(vars(datamodule).items()):
        if name.startswith("_") or name in SETUP_STATE:
            continue
        if name == "features":
            value = None if value is None else (type(value).__qualname__, value.describe())
        elif not isinstance(value, (bool, int, float, str, tuple, list, dict, type(None))):
            continue  # Lightning's own attributes (trainer, hparams): not settings of the data
        settings[name] = value
    return repr((type(datamodule).__module__, type(datamodule).__qualname__, settings))


def shared_setup(datamodule: Any, setup: Callable[[], None]) -> None:
    """Run ``setup()`` for ``datamodule``, or take the result of an equal datamodule's (inside
    :func:`shared_setups`; one setup at a time, so equal datamodules never load twice)."""
    if _SHARED is None:
        setup()
        return
    with _LOCK:
        key = setup_key(datamodule)
        state = _SHARED.get(key)
        if state is None:
            setup()
            _SHARED[key] = {name: getattr(datamodule, name) for name in SETUP_STATE}
            return
        for name, value in state.items():
            setattr(datamodule, name, value)
