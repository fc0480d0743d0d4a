"""The README's design section names every shipped algorithm and callback (issue 26)."""

from __future__ import annotations

import inspect

import callbacks
import fedfdp.algorithms as algorithms
from tests.conftest import REPO


def _design_section() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("\n## Design\n")
    return text[start:text.index("\n## ", start + 1)]


def test_every_algorithm_and_callback_is_in_the_design_section():
    design = _design_section()
    shipped = [n for module in (algorithms, callbacks) for n in module.__all__
               if inspect.isclass(getattr(module, n))]
    missing = [n for n in shipped if f"`{n}`" not in design]
    assert not missing, f"add {missing} to the README's design section"
    assert len(shipped) >= 40  # 31 algorithm classes and helpers, 12 callbacks at the time of writing
