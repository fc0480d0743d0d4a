"""A class of the configuration that cannot be built from its ``init_args``: one line naming it.

jsonargparse builds every class the configuration names (the net, the algorithm, the datamodule,
the callbacks; the server optimizer when the federation calls it) through its instantiator.
When a constructor that fedfdp does not own refuses its arguments (``torch.nn.Linear`` with a
negative width, ``torch.optim.SGD`` with a negative learning rate, a ``groups`` that does not
divide the channels), the error is whatever that library raises. :func:`construction_error`
recognises an exception raised inside such a constructor, wherever it surfaces, and names the
configuration key, the class and its arguments. An exception raised anywhere else (a bug) is
left alone: it stays a traceback (exit status 1).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

from fedfdp.cli.errors import one_line

__all__ = ["construction_error"]

#: (file suffix, function) of the frames that call a configured class's constructor
_INSTANTIATORS = ((os.path.join("jsonargparse", "_instantiation.py"), "default_class_instantiator"),
                  (os.path.join("lightning", "pytorch", "cli.py"), "__call__"))


def _built_class(err: BaseException) -> tuple[type, dict[str, Any]] | None:
    """The innermost class (and its keyword arguments) being built by an instantiator when ``err`` was raised."""
    found = None
    for frame, _ in traceback.walk_tb(err.__traceback__):
        code = frame.f_code
        if any(code.co_filename.endswith(suffix) and code.co_name == name for suffix, name in _INSTANTIATORS):
            class_type = frame.f_locals.get("class_type")
            if isinstance(class_type, type):
                found = (class_type, dict(frame.f_locals.get("kwargs") or {}))
    return found


def _class_keys(config: Any, key: str = "") -> Iterator[tuple[str, str]]:
    """``(dotted key, class_path)`` of every ``class_path`` in a configuration dict."""
    if isinstance(config, Mapping):
        if isinstance(config.get("class_path"), str):
            yield key, config["class_path"]
        for name, value in config.items():
            yield from _class_keys(value, f"{key}.{name}" if key else str(name))
    elif isinstance(config, (list, tuple)):
        for i, value in enumerate(config):
            yield from _class_keys(value, f"{key}[{i}]")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"<{type(value).__name__}>"


def construction_error(err: BaseException, config: Mapping[str, Any] | None = None) -> str | None:
    """One line when ``err`` was raised building a configured class, else ``None``.

    Args:
        err: the exception.
        config: the parsed configuration as a dict, to name the key (``model.client.init_args.net``).
    """
    built = _built_class(err)
    if built is None:
        return None
    class_type, kwargs = built
    path = f"{class_type.__module__}.{class_type.__qualname__}"
    short_names = {path, f"{class_type.__module__.split('.')[0]}.{class_type.__qualname__}"}
    keys = [k for k, p in _class_keys(config or {}) if p in short_names or p.rsplit(".", 1)[-1] == class_type.__name__]
    where = f"{keys[0]}: " if keys else ""
    arguments = ", ".join(f"{k}={_short(v)}" for k, v in kwargs.items() if k != "applied_instantiation_links")
    return (f"{where}{class_type.__name__}({arguments}) cannot be built from its init_args: "
            f"{type(err).__name__}: {one_line(str(err))[:200]}")
