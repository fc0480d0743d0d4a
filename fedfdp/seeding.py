"""Explicit, resumable randomness, and a cryptographically secure alternative.

Every random draw of a run comes from a generator derived from ``(seed, round, client, stream)``
with numpy's ``SeedSequence``. A round therefore draws the same numbers whether the run was
interrupted and resumed or not, without storing generator states in checkpoints.

``torch.Generator`` (Mersenne Twister) is reproducible but predictable: fine for research, not
for a deployment whose adversary could reconstruct the noise. With ``secure_rng: true`` the
federation hands out :class:`SecureGenerator` objects instead, which draw Poisson masks and
Gaussian noise from the operating system's CSPRNG (``os.urandom``), like Opacus' secure mode.
Runs are then not reproducible. (Floating-point attacks on the Gaussian sampler, Mironov 2012,
are not addressed by either source.)
"""

from __future__ import annotations

import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor

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


class SecureGenerator:
    """Uniform and Gaussian draws from ``os.urandom`` (a CSPRNG), for production noise.

    Args:
        device: device of the returned tensors.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def uniform(self, n: int) -> torch.Tensor:
        """``n`` float64 uniforms in ``(0, 1]`` with 53 random bits each."""
        bits = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(11)
        return torch.from_numpy((bits.astype(np.float64) + 1.0) / float(2**53))

    def normal(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Standard normal draws by the Box-Muller transform of CSPRNG uniforms."""
        n = math.prod(shape)
        u1, u2 = self.uniform(n), self.uniform(n)
        z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
        return z.reshape(shape).to(device=self.device, dtype=dtype)


RandomSource = torch.Generator | SecureGenerator
"""Where a private step draws its sampling and noise randomness from."""


def make_generator(seed: int, *keys: int | str, device: torch.device | str = "cpu",
                   secure: bool = False) -> RandomSource:
    """A seeded ``torch.Generator`` for stream ``keys``, or a :class:`SecureGenerator` when ``secure``."""
    return SecureGenerator(device) if secure else torch_generator(seed, *keys, device=device)


def rand(n: int, generator: RandomSource) -> torch.Tensor:
    """``n`` uniforms in [0, 1) on the generator's device."""
    if isinstance(generator, SecureGenerator):
        return generator.uniform(n).to(generator.device) - 2.0**-53
    return torch.rand(n, generator=generator, device=generator.device)


_SPLIT_NORMALS_AT = 2**17
"""CPU draws at least this large are generated in two halves on two threads (see :func:`randn`)."""

_noise_worker: ThreadPoolExecutor | None = None


def _forget_noise_worker() -> None:  # a forked child (e.g. ddp_fork) must not reuse the parent's thread
    global _noise_worker
    _noise_worker = None


os.register_at_fork(after_in_child=_forget_noise_worker)


def randn(shape: tuple[int, ...] | torch.Size, generator: RandomSource, *, dtype: torch.dtype = torch.float32,
          device: torch.device | str | None = None) -> torch.Tensor:
    """Standard normal draws of ``shape``.

    On CPU, torch draws normals from one Mersenne Twister serially, which costs about as much as
    the per-sample norms of a small CNN's DP step. Large draws are therefore split: the first half
    comes from ``generator``, the second from a generator seeded by one 62-bit draw of
    ``generator``, filled concurrently on a worker thread (torch releases the GIL). The split is
    fixed (not tied to the thread count), so a seed gives the same noise on every machine.
    """
    global _noise_worker
    if isinstance(generator, SecureGenerator):
        return generator.normal(shape, dtype).to(device or generator.device)
    device = torch.device(device or generator.device)
    numel = math.prod(shape)
    if device.type != "cpu" or numel < _SPLIT_NORMALS_AT:
        return torch.randn(shape, generator=generator, dtype=dtype, device=device)
    second = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
    out = torch.empty(numel, dtype=dtype)
    half = numel // 2
    if _noise_worker is None:
        _noise_worker = ThreadPoolExecutor(1, thread_name_prefix="fedfdp-noise")
    pending = _noise_worker.submit(out[half:].normal_, generator=second)
    out[:half].normal_(generator=generator)
    pending.result()
    return out.view(shape)


def randperm(n: int, generator: RandomSource) -> torch.Tensor:
    """A random permutation of ``range(n)``."""
    if isinstance(generator, SecureGenerator):
        return torch.argsort(generator.uniform(n)).to(generator.device)
    return torch.randperm(n, generator=generator, device=generator.device)


def poisson_mask(n: int, sample_rate: float, generator: RandomSource) -> torch.Tensor:
    """Poisson subsampling: each of ``n`` records is included independently with probability q."""
    return rand(n, generator) < sample_rate


def select_rows(mask: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The rows of each tensor where ``mask`` is true, in order: ``t[mask]`` for each ``t``.

    Written as one ``nonzero`` and an ``index_select`` per tensor: the same rows, bit for bit, as
    boolean indexing, which on wide records (a ScatterNet feature is 3,969 floats) costs 2.5 times
    as much on this CPU (advanced indexing goes through a generic gather kernel).
    """
    index = mask.nonzero().squeeze(1)
    return tuple(t.index_select(0, index) for t in tensors)
