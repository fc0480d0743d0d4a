"""The design page (docs/design.md, moved there from the README) names every shipped algorithm and
callback (issue 26)."""

from __future__ import annotations

import inspect

import callbacks
import fedfdp.algorithms as algorithms
from tests.conftest import REPO


def _design_tables() -> str:
    text = (REPO / "docs" / "design.md").read_text()
    start = text.index("\n## Every algorithm and callback\n")
    return text[start:text.index("\n## ", start + 1)]


def test_every_algorithm_and_callback_is_in_the_design_page():
    design = _design_tables()
    shipped = [n for module in (algorithms, callbacks) for n in module.__all__
               if inspect.isclass(getattr(module, n))]
    missing = [n for n in shipped if f"`{n}`" not in design]
    assert not missing, f"add {missing} to docs/design.md, 'Every algorithm and callback'"
    # 23 algorithm classes and helpers (8 private twins became privacy=, fedfdp.algorithms.RETIRED), 12 callbacks
    assert len(shipped) >= 35
    retired = [n for n in algorithms.RETIRED if f"`{n}`" in design]
    assert not retired, f"docs/design.md still lists retired twin classes {retired}"


def test_the_readme_links_to_the_design_page():
    assert "](docs/design.md)" in (REPO / "README.md").read_text()
