"""fedfdp.memory: the convolution-primitive caches are bounded, so Poisson-sized batches do not pile up memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

# Convolutions on 150 batch sizes never seen before, as a private round's Poisson batches are; prints
# the growth of the C heap's in-use bytes (glibc mallinfo2) in MB. The caches' capacities are read
# at the first convolution, so this runs in a fresh process.
_PROBE = """
import ctypes, json, torch
import fedfdp.memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
torch.set_num_threads(1)
conv = torch.nn.Conv2d(1, 8, 5)
with torch.no_grad():
    conv(torch.zeros(4, 1, 12, 12))
    before = libc.mallinfo2().uordblks
    for size in range(10, 160):
        conv(torch.zeros(size, 1, 12, 12))
    print(json.dumps((libc.mallinfo2().uordblks - before) / 2**20))
"""


def _growth_mb(**env: str) -> float:
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, env={**environment, **env},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return float(json.loads(out.strip().splitlines()[-1]))


def test_importing_the_federation_bounds_the_kernel_caches():
    import fedfdp.federation  # noqa: F401
    from fedfdp.memory import KERNEL_CACHE_CAPACITY

    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        assert 1 <= int(os.environ[name]) <= KERNEL_CACHE_CAPACITY


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallinfo2")
def test_new_batch_shapes_do_not_accumulate_cached_kernels():
    unbounded = _growth_mb(ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024", LRU_CACHE_CAPACITY="1024")
    if unbounded < 2.0:
        pytest.skip(f"this torch build caches no convolution primitives on CPU (+{unbounded:.1f} MB)")
    bounded = _growth_mb()
    assert bounded < 0.25 * unbounded, (bounded, unbounded)
