"""Seeded synthetic class-conditional images for fast tests and smoke runs (no files needed).

Each class ``k`` has a random prototype image ``m_k ~ U(0, 1)``; a sample of class ``k`` is
``clip(m_k + 0.3 * N(0, I), 0, 1)``, stored as ``uint8`` like a real image dataset (generated in
chunks, so 10,000 clients' worth of images never exist as float32). Classes are balanced, so a
small CNN (or even a linear model) separates them easily.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from datamodules.federated import FederatedDataModule, check_fields

__all__ = ["SyntheticDataModule"]

_NOISE_STD = 0.3
_CHUNK = 8192


def _int_at_least(value: object, minimum: int) -> bool:
    """Whether ``value`` is an integer >= ``minimum`` and not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= minimum


class SyntheticDataModule(FederatedDataModule):
    """Random but learnable images: per-class prototypes plus Gaussian noise.

    Args:
        num_samples: Total number of samples before partitioning (>= 1).
        image_shape: ``(C, H, W)`` of every image.
        num_classes: Number of classes (>= 2); labels are balanced.
        seed: Seed of the generated data (independent of ``partition_seed``).
        **kwargs: Arguments of :class:`FederatedDataModule` (``num_clients``, ``alpha``, ...).
    """

    def __init__(
        self,
        *,
        num_samples: int = 2000,
        image_shape: tuple[int, int, int] = (1, 28, 28),
        num_classes: int = 10,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_fields(
            num_samples=(num_samples, _int_at_least(num_samples, 1), "an integer >= 1"),
            image_shape=(
                image_shape,
                isinstance(image_shape, (tuple, list))
                and len(image_shape) == 3
                and all(_int_at_least(d, 1) for d in image_shape),
                "three integers (C, H, W) >= 1",
            ),
            num_classes=(num_classes, _int_at_least(num_classes, 2), "an integer >= 2"),
            seed=(seed, _int_at_least(seed, 0), "an integer >= 0"),
        )
        self.num_samples = int(num_samples)
        self.image_shape = (int(image_shape[0]), int(image_shape[1]), int(image_shape[2]))
        self.num_classes = int(num_classes)  # instance value overrides the class default
        self.seed = int(seed)
        self.mean = (0.5,) * self.image_shape[0]
        self.std = (0.5,) * self.image_shape[0]
        self.expected_input_shape = self.image_shape

    def load_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Generate ``(images uint8 (N, C, H, W), labels int64, None, None)``."""
        rng = np.random.default_rng(self.seed)
        prototypes = rng.uniform(0.0, 1.0, size=(self.num_classes, *self.image_shape)).astype(np.float32)
        labels = rng.permutation(np.arange(self.num_samples, dtype=np.int64) % self.num_classes)
        images = np.empty((self.num_samples, *self.image_shape), dtype=np.uint8)
        for start in range(0, self.num_samples, _CHUNK):  # same stream as one draw, less memory
            stop = min(self.num_samples, start + _CHUNK)
            noise = rng.standard_normal(size=(stop - start, *self.image_shape), dtype=np.float32)
            chunk = np.clip(prototypes[labels[start:stop]] + _NOISE_STD * noise, 0.0, 1.0)
            images[start:stop] = np.rint(chunk * 255.0)
        return images, labels, None, None

    def partition_config(self) -> dict[str, Any]:
        """Base settings plus the generator's, which change the data and hence the partition."""
        return {
            **super().partition_config(),
            "num_samples": self.num_samples,
            "image_shape": list(self.image_shape),
            "num_classes": self.num_classes,
            "seed": self.seed,
        }
