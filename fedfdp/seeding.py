"""Explicit, resumable randomness.

Every random draw of a run comes from a generator derived from ``(seed, round, client, stream)``
with numpy's ``SeedSequence``. A round therefore draws the same numbers whether the run was
interrupted and resumed or not, without storing generator states in checkpoints.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch


def derive_seed(seed: int, *keys: int | str) -> int:
    """A 63-bit seed for the stream named by ``keys`` (ints or strings) under the run ``seed``."""
    words = [seed] + [zlib.crc32(k.encode()) if isinstance(k, str) else int(k) for k in keys]
    return int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def torch_generator(seed: int, *keys: int | str, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded for the stream ``keys``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(derive_seed(seed, *keys))
    return gen


def numpy_generator(seed: int, *keys: int | str) -> np.random.Generator:
    """A numpy ``Generator`` seeded for the stream ``keys``."""
    return np.random.default_rng(derive_seed(seed, *keys))


def poisson_mask(n: int, sample_rate: float, generator: torch.Generator) -> torch.Tensor:
    """Poisson subsampling: each of ``n`` records is included independently with probability q."""
    return torch.rand(n, generator=generator, device=generator.device) < sample_rate
