"""Fixed, data-independent feature extractors applied to every image once, at setup.

:class:`ScatteringFeatures` is the ScatterNet front end of Tramèr & Boneh (ICLR 2021,
"Differentially Private Learning Needs Better Features"): a 2-D wavelet scattering transform
(Mallat 2012; Bruna & Mallat 2013) with ``J`` scales and ``L`` angles, computed by kymatio.
Its filters are fixed Morlet wavelets, chosen without looking at any data, so mapping each
client's images through it releases nothing and costs no privacy: only the model trained on
the features does, and it is charged as before. For ``C`` input channels the output has
``C · (1 + J·L + L²·J(J−1)/2)`` channels at ``H / 2^J × W / 2^J`` (81 × 7 × 7 for a 28 × 28
grey image at ``J = 2, L = 8``).

The features are not normalised by data statistics: a per-channel mean and variance over the
clients' data would be a release that must be charged. Normalise inside the model with a
per-sample GroupNorm instead (:class:`fedfdp.models.ScatterLinear`, as Tramèr & Boneh's
"group normalisation" variant).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from datamodules.checks import check_fields, is_int
from fedfdp.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

__all__ = ["ScatteringFeatures"]


def _scattering_class() -> type:
    """kymatio's torch Scattering2D (a clear ConfigError when kymatio is not installed).

    Imported from the 2-D frontend module rather than ``kymatio.torch``: the latter also imports
    the 3-D solid-harmonic filter bank, which needs ``scipy.special.sph_harm`` (removed in SciPy
    1.15), so ``import kymatio.torch`` fails with current SciPy although the 2-D transform works.
    """
    try:
        from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D
    except ImportError as exc:  # pragma: no cover - exercised only without the extra installed
        raise ConfigError(
            f"data.features: ScatteringFeatures needs kymatio ({exc}); install it with "
            "pip install -e '.[scatter]'"
        ) from exc
    return ScatteringTorch2D


class ScatteringFeatures:
    """2-D wavelet scattering of normalised images, ``(N, C, H, W) → (N, C·K, H/2^J, W/2^J)``.

    Args:
        J: number of scales (>= 1); the output is ``2^J`` times smaller per side, and ``H`` and
            ``W`` must be divisible by ``2^J``.
        L: number of angles (>= 1).
        batch_size: images transformed at once (memory only; the result does not depend on it).
        cache_dir: folder where :meth:`extract` keeps the features of a whole dataset, one file
            named by the sha256 of the raw images, their normalisation and ``J``, ``L`` (about 1.1
            GB for FashionMNIST), so the next run on the same data loads them instead of spending a
            minute recomputing them. ``None`` (the default): always compute.
        group_norm: normalise every sample's features by a GroupNorm of this many groups without
            parameters (Tramèr & Boneh's "group normalisation", 27 for K = 81), once, here, instead
            of in every forward pass of the model (``fedfdp.models.ScatterLinear(groups=None)``):
            the same per-sample function, data-independent, so still no privacy cost. ``None``
            (the default): the features as the transform gives them.
    """

    def __init__(self, J: int = 2, L: int = 8, batch_size: int = 1024, cache_dir: str | None = None,
                 group_norm: int | None = None) -> None:
        check_fields(
            **{
                "features.J": (J, is_int(J, 1), "an integer >= 1"),
                "features.L": (L, is_int(L, 1), "an integer >= 1"),
                "features.batch_size": (batch_size, is_int(batch_size, 1), "an integer >= 1"),
                "features.cache_dir": (cache_dir, cache_dir is None or (isinstance(cache_dir, str) and cache_dir != ""),
                                       "null or a non-empty path"),
            }
        )
        check_fields(**{"features.group_norm": (group_norm, group_norm is None or is_int(group_norm, 1),
                                                "null or an integer >= 1 dividing the feature channels")})
        self.J, self.L, self.batch_size = int(J), int(L), int(batch_size)
        self.cache_dir = cache_dir
        self.group_norm = None if group_norm is None else int(group_norm)

    @property
    def channels_per_input_channel(self) -> int:
        """``K = 1 + J·L + L²·J(J−1)/2``: the zeroth, first and second order coefficients."""
        return 1 + self.J * self.L + self.L**2 * self.J * (self.J - 1) // 2

    def output_shape(self, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
        """``(C·K, H/2^J, W/2^J)`` for an input of ``(C, H, W)``; DataError when ``2^J`` does not divide H, W."""
        c, h, w = input_shape
        step = 2**self.J
        if h % step or w % step:
            raise DataError(
                f"data.features: ScatteringFeatures(J={self.J}) needs image sides divisible by {step}, got {h}x{w}"
            )
        return c * self.channels_per_input_channel, h // step, w // step

    def describe(self) -> dict[str, object]:
        """The settings that determine the features (part of the data fingerprint)."""
        described: dict[str, object] = {"name": "scattering", "J": self.J, "L": self.L}
        if self.group_norm is not None:  # absent when off: earlier fingerprints and caches stay valid
            described["group_norm"] = self.group_norm
        return described

    def extract(self, raw: np.ndarray, normalize: Callable[[Tensor], Tensor], normalization: str) -> Tensor:
        """Features of a whole dataset of raw images ``(N, C, H, W)``, normalised slice by slice.

        Args:
            raw: the images as loaded (``uint8`` or float).
            normalize: raw slice -> float32 model input of the pixels.
            normalization: a description of ``normalize`` (mean, std), part of the cache key.

        With ``cache_dir`` the result is read from, or written (atomically) to, the file of this
        exact input; the features are a deterministic function of it, so a cached file equals a
        recomputation.
        """
        path = None
        if self.cache_dir is not None:
            digest = hashlib.sha256()
            digest.update(repr((raw.shape, str(raw.dtype), normalization, self.describe())).encode())
            digest.update(np.ascontiguousarray(raw).data)
            path = Path(self.cache_dir) / f"scattering-{digest.hexdigest()[:32]}.pt"
            if path.is_file():
                try:
                    cached = torch.load(path, map_location="cpu", weights_only=True)
                except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
                    logger.warning("scattering cache %s unreadable (%s): recomputing it", path, exc)
                else:
                    if isinstance(cached, Tensor) and cached.shape == (len(raw), *self.output_shape(raw.shape[1:])):
                        logger.info("scattering features (J=%d, L=%d) of %d images read from %s",
                                    self.J, self.L, len(raw), path)
                        return cached
                    logger.warning("scattering cache %s holds another shape: recomputing it", path)
        out = torch.empty((len(raw), *self.output_shape(raw.shape[1:])), dtype=torch.float32)
        step = 8192  # normalise a slice at a time: a float32 copy of every image is never held
        for lo in range(0, len(raw), step):
            out[lo:lo + step] = self(normalize(torch.from_numpy(raw[lo:lo + step])))
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
                torch.save(out, partial)
                os.replace(partial, path)  # atomic: parallel runs never read a half-written file
                logger.info("scattering features cached in %s", path)
            except OSError as exc:  # a cache: the run goes on with the features it computed
                logger.warning("scattering cache not written to data.features.cache_dir=%s (%s)", self.cache_dir, exc)
        return out

    @torch.no_grad()
    def __call__(self, images: Tensor) -> Tensor:
        """Scattering coefficients of float ``images`` ``(N, C, H, W)``, float32 ``(N, C·K, H/2^J, W/2^J)``."""
        if images.ndim != 4:
            raise DataError(f"data.features: images must be (N, C, H, W), got {tuple(images.shape)}")
        n, c, h, w = images.shape
        out_shape = self.output_shape((c, h, w))
        if self.group_norm is not None and out_shape[0] % self.group_norm:
            raise ConfigError(f"data.features.group_norm must divide the {out_shape[0]} feature channels, "
                              f"got {self.group_norm}")
        transform = _scattering_class()(J=self.J, shape=(h, w), L=self.L)
        out = torch.empty((n, *out_shape), dtype=torch.float32)
        start = time.perf_counter()
        for lo in range(0, n, self.batch_size):
            batch = images[lo:lo + self.batch_size].to(torch.float32)
            # kymatio returns (B, C, K, H', W'); channels of one input channel stay adjacent
            features = transform(batch).reshape(len(batch), *out_shape)
            if self.group_norm is not None:  # exactly the model's nn.GroupNorm(groups, K, affine=False)
                features = torch.nn.functional.group_norm(features, self.group_norm)
            out[lo:lo + len(batch)] = features
        logger.info("scattering features (J=%d, L=%d) of %d images: %s in %.1f s",
                    self.J, self.L, n, out_shape, time.perf_counter() - start)
        return out
