"""YAML read strictly: a mapping that gives a key twice is an error, not "the last one wins".

PyYAML (and jsonargparse, which reads configs with it) keeps the last value of a key given twice,
so a config that sets ``num_rounds`` twice runs with one of them and says nothing. Every YAML file
fedfdp reads (configs, run directories' saved configs, search spaces, sweep grids) and every YAML
value jsonargparse parses (``fedfdp.cli.parser`` installs :func:`jsonargparse_load`) goes through
:class:`StrictSafeLoader` instead, which refuses the second occurrence with the line of both.

Written by hand: PyYAML has no option for it (yaml/pyyaml#41) and jsonargparse takes a loader.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml import YAMLError
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode

__all__ = ["DuplicateKeyError", "StrictSafeLoader", "YAMLError", "load", "strict"]


class DuplicateKeyError(ConstructorError):
    """A mapping gives the same key twice."""


def _check_unique(loader: yaml.BaseLoader, node: MappingNode) -> None:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *anchor``: keys given after it override it
            continue
        key = loader.construct_object(key_node, deep=True)  # type: ignore[arg-type]
        line = key_node.start_mark.line + 1
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key: PyYAML refuses it itself
            continue
        if first is not None:
            raise DuplicateKeyError(None, None, f"the key {key!r} is given twice (lines {first} and {line}); a "
                                                f"mapping holds each key once", key_node.start_mark)
        seen[key] = line


def strict(base: type[yaml.BaseLoader]) -> type[yaml.BaseLoader]:
    """``base`` with mappings that refuse a key given twice."""

    class Strict(base):  # type: ignore[valid-type, misc]
        def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
            if isinstance(node, MappingNode):
                _check_unique(self, node)
            return super().construct_mapping(node, deep=deep)

    Strict.__name__ = f"Strict{base.__name__}"
    return Strict


#: ``yaml.SafeLoader`` refusing duplicate keys.
StrictSafeLoader = strict(yaml.SafeLoader)


def load(text: str) -> Any:
    """``yaml.safe_load(text)``, refusing a key given twice (:class:`DuplicateKeyError`, a ``yaml.YAMLError``)."""
    return yaml.load(text, Loader=StrictSafeLoader)  # noqa: S506 - a SafeLoader subclass
