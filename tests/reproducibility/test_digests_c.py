"""Cases of group "c" of tests/reproducibility/runs.py (see test_digests.py)."""

from __future__ import annotations

import pytest

from tests.reproducibility.runs import CASES, check_case

GROUP = "c"


@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in CASES if c.group == GROUP])
def test_run_reproduces_its_digest(name, tmp_path):
    check_case(name, tmp_path)
