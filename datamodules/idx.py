"""Reading, locating and verifying IDX files (the MNIST / Fashion-MNIST file format).

An IDX file is ``0x00 0x00 <dtype code> <ndim>``, then ``ndim`` big-endian uint32 sizes,
then the array in C order and big-endian byte order. Files may be gzip-compressed (``.gz``).
Checksums are md5s of the *decompressed* content, so they hold for the upstream ``.gz`` files,
for torchvision's extracted copies and for Debian's re-gzipped package alike.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import socket
import threading
import urllib.parse
import zlib
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Literal

import numpy as np

from datamodules.paths import DATA_DIR_ENV, data_roots, download_root
from fedfdp.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

__all__ = [
    "FILE_NAMES",
    "IDX_DATASETS",
    "IDXDatasetSpec",
    "candidate_dirs",
    "find_idx_files",
    "load_idx_dataset",
    "read_idx",
]

_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

#: Keys of the returned file dicts and the standard IDX file names (without ``.gz``).
FILE_NAMES: dict[str, str] = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


@dataclass(frozen=True)
class IDXDatasetSpec:
    """Where an IDX dataset may live and the md5s of its decompressed files.

    Attributes:
        torchvision_name: Class name in ``torchvision.datasets`` (also its folder name).
        folder: Conventional folder name below ``data_dir`` (``fashion-mnist``).
        md5: Md5 of each decompressed file, keyed like :data:`FILE_NAMES`.
        extra_dirs: System folders searched last (Debian's dataset package).
    """

    torchvision_name: str
    folder: str
    md5: dict[str, str]
    extra_dirs: tuple[Path, ...] = field(default_factory=tuple)


IDX_DATASETS: dict[str, IDXDatasetSpec] = {
    "FashionMNIST": IDXDatasetSpec(
        torchvision_name="FashionMNIST",
        folder="fashion-mnist",
        md5={
            "train_images": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
            "train_labels": "9018921c3c673c538a1fc5bad174d6f9",
            "test_images": "8181f5470baa50b63fa0f6fddb340f0a",
            "test_labels": "15d484375f8d13e6eb1aabb0c3f46965",
        },
        extra_dirs=(Path("/usr/share/datasets/fashion-mnist"),),
    ),
    "MNIST": IDXDatasetSpec(
        torchvision_name="MNIST",
        folder="mnist",
        md5={
            "train_images": "6bbc9ace898e44ae57da46a324031adb",
            "train_labels": "a25bea736e30d166cdddb491f175f624",
            "test_images": "2646ac647ad5339dbf082846283269ea",
            "test_labels": "27ae3e4e09519cfbb04c329615203637",
        },
    ),
}


def _read_bytes(path: Path) -> bytes:
    """Return the (decompressed, if ``.gz``) content of ``path``; DataError if unreadable."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fh:
                return fh.read()
        return path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        reason = " ".join(str(exc).split())
        raise DataError(f"{path}: cannot read (expected a readable IDX file, gzip or raw): {reason}") from exc


def _check_md5(data: bytes, path: Path, expected: str) -> None:
    """Raise DataError naming ``path`` unless ``md5(data) == expected``."""
    digest = hashlib.md5(data).hexdigest()
    if digest != expected:
        raise DataError(
            f"{path}: md5 of the decompressed content is {digest}, expected {expected} "
            "(corrupted or a different file; set data.verify: false to skip this check)"
        )


def _parse_idx(data: bytes, path: Path) -> np.ndarray:
    """Parse the bytes of an IDX file into a native-endian array, validating the header."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DataError(
            f"{path}: bad IDX magic number {data[:4].hex() or 'empty'}; expected 0000 + dtype code + ndim"
        )
    code, ndim = data[2], data[3]
    if code not in _DTYPES:
        raise DataError(
            f"{path}: unknown IDX dtype code 0x{code:02x}; expected one of "
            + ", ".join(f"0x{c:02x}" for c in _DTYPES)
        )
    if ndim < 1:
        raise DataError(f"{path}: IDX header has ndim=0; expected ndim >= 1")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{path}: truncated IDX header: {len(data)} bytes, expected >= {header}")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = _DTYPES[code]
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        raise DataError(
            f"{path}: {'truncated' if len(data) < expected else 'oversized'} IDX file: "
            f"{len(data)} bytes, expected {expected} for shape {shape} of {dtype.name}"
        )
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def read_idx(
    path: str | PathLike[str], *, ndim: int | None = None, expected_md5: str | None = None
) -> np.ndarray:
    """Read an IDX file (``.gz`` or uncompressed) into a native-endian numpy array.

    Args:
        path: File to read.
        ndim: Required number of dimensions (3 for images, 1 for labels); ``None`` accepts any.
        expected_md5: Md5 the decompressed content must have; ``None`` skips the check.

    Returns:
        The array with the shape given in the header (``uint8`` for the MNIST family).

    Raises:
        DataError: Naming the file when it cannot be read, its magic number, dtype code or
            ndim is wrong, its size does not match the header, or its md5 differs.
    """
    path = Path(path)
    data = _read_bytes(path)
    if expected_md5 is not None:
        _check_md5(data, path, expected_md5)
    array = _parse_idx(data, path)
    if ndim is not None and array.ndim != ndim:
        raise DataError(f"{path}: IDX array has shape {array.shape} (ndim={array.ndim}), expected ndim={ndim}")
    if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
        bad = np.flatnonzero(~np.isfinite(array.reshape(len(array), -1)).all(axis=1))
        raise DataError(f"{path}: {int((~np.isfinite(array)).sum())} NaN/Inf values (first in sample "
                        f"{int(bad[0])}); expected finite numbers")
    return array


def _spec(dataset_name: str) -> IDXDatasetSpec:
    """Return the :class:`IDXDatasetSpec` of ``dataset_name`` or raise ConfigError."""
    if dataset_name not in IDX_DATASETS:
        raise ConfigError(f"dataset_name must be one of {sorted(IDX_DATASETS)}, got {dataset_name!r}")
    return IDX_DATASETS[dataset_name]


def candidate_dirs(data_dir: str | PathLike[str], dataset_name: str) -> list[Path]:
    """Return the folders searched for ``dataset_name``'s files, in search order.

    Every root of :func:`datamodules.paths.data_roots` (``data_dir``, ``$FEDFDP_DATA_DIR``, ``data_dir``
    relative to the checkout, ``~/.cache/fedfdp``) with its layouts ``<root>``,
    ``<root>/<TorchvisionName>/raw`` and ``<root>/<folder>``, then the dataset's system folders.
    """
    spec = _spec(dataset_name)
    dirs = [d for root in data_roots(data_dir) for d in (root, root / spec.torchvision_name / "raw", root / spec.folder)]
    return list(dict.fromkeys([*dirs, *spec.extra_dirs]))


def _files_in(folder: Path) -> dict[str, Path]:
    """Map each file key to its path in ``folder`` (uncompressed preferred over ``.gz``)."""
    found: dict[str, Path] = {}
    for key, name in FILE_NAMES.items():
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.is_file():
                found[key] = candidate
                break
    return found


#: Seconds to wait for a mirror to accept a connection before a download is given up.
PROBE_TIMEOUT_S = 5.0
#: Seconds a stalled download may wait for data before it fails.
DOWNLOAD_TIMEOUT_S = 60.0

Download = bool | Literal["auto"]


def probe_network(url: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """``None`` when ``url``'s host accepts a TCP connection within ``timeout`` s, else the reason.

    Runs in a daemon thread, so a hanging name lookup cannot hang the caller.
    """
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or url
    port = parts.port or (443 if parts.scheme == "https" else 80)
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(" ".join(str(exc).split()) or type(exc).__name__)

    thread = threading.Thread(target=connect, name="fedfdp-network-probe", daemon=True)
    thread.start()
    thread.join(timeout + 1.0)
    if not outcome:
        return f"offline? no answer from {host} within {timeout:g} s"
    return None if outcome[0] is None else f"offline? cannot reach {host}: {outcome[0]}"


def _download(target: Path, spec: IDXDatasetSpec) -> str | None:
    """Fetch the dataset with torchvision into ``target/<Name>/raw``; ``None`` or why it failed.

    The mirrors are probed first (a few seconds at most), so an offline machine fails fast
    instead of waiting on the network; a stalled transfer fails after :data:`DOWNLOAD_TIMEOUT_S`.
    """
    import torchvision.datasets as tvd

    dataset = getattr(tvd, spec.torchvision_name)
    mirrors = list(getattr(dataset, "mirrors", []) or [])
    if mirrors:
        reasons = [probe_network(url) for url in mirrors]
        if all(reasons):
            return "; ".join(str(r) for r in reasons)
    logger.info("downloading %s into %s", spec.torchvision_name, target / spec.torchvision_name / "raw")
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        dataset(root=str(target), download=True)
    except Exception as exc:  # network errors come as URLError, RuntimeError, OSError, ...
        return " ".join(str(exc).split()) or type(exc).__name__
    finally:
        socket.setdefaulttimeout(previous)
    return None


def _first_complete(dirs: list[Path]) -> dict[str, Path] | None:
    """The files of the first folder in ``dirs`` that holds all four, or ``None``."""
    return next((f for f in map(_files_in, dirs) if len(f) == len(FILE_NAMES)), None)


def find_idx_files(
    data_dir: str | PathLike[str], dataset_name: str, *, verify: bool = True, download: Download = False
) -> dict[str, Path]:
    """Locate the four IDX files of a dataset, optionally downloading and verifying them.

    Searched in the order of :func:`candidate_dirs` (first folder holding all four files wins;
    each file ``.gz`` or not): every root of :func:`datamodules.paths.data_roots` with the layouts
    ``<root>``, ``<root>/<TorchvisionName>/raw`` and ``<root>/<folder>``, then, for FashionMNIST,
    ``/usr/share/datasets/fashion-mnist`` (Debian package).

    Args:
        data_dir: Root data folder.
        dataset_name: A key of :data:`IDX_DATASETS` (``"FashionMNIST"`` or ``"MNIST"``).
        verify: Check the md5 of every decompressed file against the reference.
        download: When nothing is found: ``True`` downloads through torchvision into
            :func:`datamodules.paths.download_root` (an error when that fails), ``"auto"`` tries
            the same and reports the failure in the not-found error, ``False`` does not try.

    Returns:
        Paths keyed ``train_images``, ``train_labels``, ``test_images``, ``test_labels``.

    Raises:
        DataError: When the files are missing (one line listing the folders searched, the
            expected names and how to download), the download fails, or a checksum differs.
    """
    spec = _spec(dataset_name)
    dirs = candidate_dirs(data_dir, dataset_name)
    files = _first_complete(dirs)
    failure: str | None = None
    if files is None and download in (True, "auto"):
        target = download_root(data_dir)
        failure = _download(target, spec)
        if failure is None:
            files = _first_complete([target / spec.torchvision_name / "raw"])
        elif download is True:
            raise DataError(
                f"data.download: could not download {dataset_name} into {target / spec.torchvision_name / 'raw'} "
                f"({failure}); copy the files {', '.join(f'{n}.gz' for n in FILE_NAMES.values())} into one of "
                f"{', '.join(map(str, dirs))} instead"
            )
    if files is None:
        partial = [f"{d} has only {sorted(p.name for p in f.values())}" for d in dirs if (f := _files_in(d))]
        if failure is not None:
            how = (f"the automatic download (data.download: auto) failed: {failure}; copy the files into one "
                   f"of these folders or set {DATA_DIR_ENV} to a folder holding them")
        else:
            how = (f"set data.download: true (--data.init_args.download true) to fetch them when online, or "
                   f"set {DATA_DIR_ENV} to a folder holding them")
        raise DataError(
            f"data.data_dir: {dataset_name} files not found; searched {', '.join(map(str, dirs))}"
            f"{' (' + '; '.join(partial) + ')' if partial else ''}; expected "
            f"{', '.join(FILE_NAMES.values())} (each optionally .gz); {how}"
        )
    folder = next(iter(files.values())).parent
    if folder not in dirs[:3]:
        logger.info("%s: using the files in %s (data_dir %s)", dataset_name, folder, data_dir)
    if verify:
        for key, path in files.items():
            _check_md5(_read_bytes(path), path, spec.md5[key])
    return files


def load_idx_dataset(
    data_dir: str | PathLike[str], dataset_name: str, *, verify: bool = True, download: Download = False
) -> tuple[dict[str, np.ndarray], dict[str, Path]]:
    """Find and read a dataset's four IDX files, decompressing each file only once.

    Args:
        data_dir: Root data folder (see :func:`find_idx_files` for the layouts searched).
        dataset_name: A key of :data:`IDX_DATASETS`.
        verify: Check each decompressed file's md5 while reading it.
        download: ``True``, ``"auto"`` or ``False``: see :func:`find_idx_files`.

    Returns:
        ``(arrays, paths)``: images ``(N, H, W)`` and labels ``(N,)`` keyed like
        :data:`FILE_NAMES`, and the files they came from.

    Raises:
        DataError: See :func:`find_idx_files` and :func:`read_idx`.
    """
    spec = _spec(dataset_name)
    paths = find_idx_files(data_dir, dataset_name, verify=False, download=download)
    arrays = {
        key: read_idx(path, ndim=3 if "images" in key else 1, expected_md5=spec.md5[key] if verify else None)
        for key, path in paths.items()
    }
    return arrays, paths
