"""Keeping a long run's resident memory flat.

Two things made the resident size of a run grow with its rounds (``configs/fmnist.yaml``: peak
1.6 GB after 5 rounds, 2.1 GB after 60, 3.5 GB after 683), and neither was a Python object or
a tensor the run kept:

1. **oneDNN's convolution caches.** PyTorch runs CPU convolutions through oneDNN, which JIT-compiles
   a primitive for every input *shape* and keeps it in two LRU caches of 1024 entries each
   (oneDNN's primitive cache, ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, and ideep's, ``LRU_CACHE_CAPACITY``).
   A private round's batches have Poisson sizes, so nearly every engine pass, loss release and
   per-client weight gradient has a shape never seen before: about 40 new primitives per round,
   each a few dozen small C++ allocations. The caches fill (+65 MB) in ~40 rounds, then evict and
   refill for ever.
2. **Heap fragmentation caused by them.** Those small, long-lived allocations land in the middle of
   the ~2.9 GB of short-lived activation and per-sample buffers a round allocates and frees.
   Freed blocks next to them cannot merge, later large requests fit nowhere, and glibc grows the
   heap (about +6 MB per round, never returned). Replaying a recorded malloc trace showed that
   without the allocations that outlive their round the heap stays at ~100 MB; trimming
   (``malloc_trim``), ``MALLOC_ARENA_MAX`` or a fixed ``M_MMAP_THRESHOLD`` did not stop the growth
   and cost up to 1 s of page faults per round.

:func:`bound_kernel_caches` caps both caches at :data:`KERNEL_CACHE_CAPACITY` entries: the shapes
used every round (evaluation and loss-release batches of 128) stay cached, a Poisson-sized shape
is compiled when it comes (it was rarely found in the cache anyway) and its primitive is freed
within the round. Results are bit for bit the same (the same kernels run). The variables are
read when the first convolution runs, so this is called at import (``fedfdp.federation`` imports
this module); a value already in the environment wins.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["KERNEL_CACHE_CAPACITY", "TRIM_EVERY", "bound_kernel_caches", "release_freed_memory"]

KERNEL_CACHE_CAPACITY = 16
"""Entries of oneDNN's and ideep's primitive caches (theirs: 1024 each)."""

_KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> None:
    """Cap oneDNN's and ideep's convolution-primitive caches at ``capacity`` entries (see the module).

    Sets ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` and ``LRU_CACHE_CAPACITY`` unless they are set. They
    are read once, when the process runs its first (oneDNN) convolution: call this before that.
    """
    if capacity < 1:  # ideep's cache crashes with capacity 0
        raise ValueError(f"kernel cache capacity must be >= 1, got {capacity}")
    for name in _KERNEL_CACHE_VARIABLES:
        os.environ.setdefault(name, str(capacity))


bound_kernel_caches()


def _load_malloc_trim() -> Any:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        return None


_MALLOC_TRIM = _load_malloc_trim()
TRIM_EVERY = 10


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    With the kernel caches bounded the heap no longer grows; trimming every ``TRIM_EVERY`` rounds
    only lowers the resident size between the rounds' peaks (the pages a round touches fault back
    in, which is why it does not run every round).
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
