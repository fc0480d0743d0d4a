"""The reference runs of tests/reproducibility/runs.py reproduce digests.json bit for bit.

Each case is a 20-round run through ``python -m fedfdp.fit`` (or the sweep) in a subprocess, with
one thread; its digest (final model, every checkpoint tensor and state, privacy ledger, ε, δ,
status, metrics) must equal the stored one field by field. The cases are spread over three files
(this one, test_digests_b.py, test_digests_c.py: about 4 minutes each on a 2-core machine) so that
pytest-xdist's ``--dist loadfile`` can run them side by side. digests.json was computed from
commit aab08f7; ``python -m tests.reproducibility.runs --write`` recomputes it (only from a commit
whose results are the reference).
"""

from __future__ import annotations

import pytest

from tests.reproducibility.runs import CASES, check_case, load_digests

GROUP = "a"


@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in CASES if c.group == GROUP])
def test_run_reproduces_its_digest(name, tmp_path):
    check_case(name, tmp_path)


def test_every_case_has_a_digest_and_a_test_file():
    """digests.json holds exactly the cases, and every case's group is run by one of the three files."""
    assert sorted(load_digests()) == sorted(c.name for c in CASES)
    assert {c.group for c in CASES} <= {"a", "b", "c"}
