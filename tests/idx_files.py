"""Tiny IDX files (the MNIST/FashionMNIST format) written by the tests, and a datamodule over them."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import numpy as np

from datamodules import FashionMNISTDataModule
from datamodules.idx import FILE_NAMES

N_TRAIN, N_TEST = 120, 40


def idx_bytes(array: np.ndarray) -> bytes:
    """Encode ``array`` as an IDX file (big-endian)."""
    codes = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D, np.float64: 0x0E}
    code = codes[array.dtype.type]
    header = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_idx(path: Path, array: np.ndarray, gz: bool) -> Path:
    """Write ``array`` to ``path`` (+ ``.gz`` when ``gz``) and return the written path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = idx_bytes(array)
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def tiny_arrays(shape: tuple[int, int] = (28, 28), max_label: int = 9) -> dict[str, np.ndarray]:
    """Small MNIST-like arrays: balanced labels 0..max_label, uint8 images."""
    rng = np.random.default_rng(0)
    out = {}
    for split, n in (("train", N_TRAIN), ("test", N_TEST)):
        out[f"{split}_images"] = rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)
        out[f"{split}_labels"] = (np.arange(n) % (max_label + 1)).astype(np.uint8)
    return out


def write_dataset(folder: Path, gz: bool | tuple[bool, ...] = False, **kwargs: Any) -> dict[str, Path]:
    """Write the four tiny IDX files into ``folder`` (``gz`` per file or for all)."""
    arrays = tiny_arrays(**kwargs)
    flags = gz if isinstance(gz, tuple) else (gz,) * 4
    return {key: write_idx(folder / name, arrays[key], f) for (key, name), f in zip(FILE_NAMES.items(), flags)}


def make_dm(data_dir: Path, **kwargs: Any) -> FashionMNISTDataModule:
    """A FashionMNIST module on tiny files (md5 check off), 4 clients."""
    args: dict = {"data_dir": str(data_dir), "num_clients": 4, "alpha": 1.0, "verify": False} | kwargs
    return FashionMNISTDataModule(**args)
