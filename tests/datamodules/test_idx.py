"""Tests of datamodules/idx.py: the IDX reader, the file finder, checksums and the download error."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import numpy as np
import pytest

from datamodules import find_idx_files, read_idx
from datamodules.idx import FILE_NAMES
from fedfdp.errors import ConfigError, DataError
from tests.idx_files import idx_bytes, make_dm, write_dataset, write_idx


# ---------------------------------------------------------------------------------- read_idx
@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32, np.float32, np.float64])
def test_read_idx_round_trip(tmp_path: Path, gz: bool, dtype: type) -> None:
    """Every IDX dtype code round-trips, compressed or not, as a native-endian array."""
    array = (np.arange(24).reshape(2, 3, 4) * 3).astype(dtype)
    path = write_idx(tmp_path / "x-idx3", array, gz)
    out = read_idx(path, ndim=3)
    np.testing.assert_array_equal(out, array)
    assert out.dtype == np.dtype(dtype) and out.dtype.isnative


def test_read_idx_truncated(tmp_path: Path) -> None:
    """A truncated file names itself and the expected byte count."""
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(idx_bytes(np.zeros((5, 28, 28), np.uint8))[:-10])
    with pytest.raises(DataError, match=rf"^{path}: truncated IDX file: .* expected {16 + 5 * 784}"):
        read_idx(path)


def test_read_idx_truncated_gzip(tmp_path: Path) -> None:
    """A cut-off gzip stream is a DataError naming the file."""
    path = tmp_path / "labels.gz"
    path.write_bytes(gzip.compress(idx_bytes(np.zeros(1000, np.uint8)))[:-30])
    with pytest.raises(DataError, match=rf"^{path}: cannot read"):
        read_idx(path)


@pytest.mark.parametrize(
    ("payload", "pattern"),
    [
        (b"\x12\x34\x08\x01" + b"\0" * 8, "bad IDX magic number 12340801"),
        (b"", "bad IDX magic number empty"),
        (b"\x00\x00\x07\x01\x00\x00\x00\x01\x00", "unknown IDX dtype code 0x07"),
        (b"\x00\x00\x08\x03\x00\x00", "truncated IDX header"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x02\x01\x02\x03", "oversized IDX file"),
    ],
)
def test_read_idx_bad_header(tmp_path: Path, payload: bytes, pattern: str) -> None:
    """Wrong magic, unknown dtype, short header and extra bytes each raise DataError."""
    path = tmp_path / "bad-idx"
    path.write_bytes(payload)
    with pytest.raises(DataError, match=rf"^{path}: {pattern}"):
        read_idx(path)


def test_read_idx_ndim_and_md5(tmp_path: Path) -> None:
    """Wrong ndim and wrong md5 are reported with the expectation."""
    path = write_idx(tmp_path / "labels", np.arange(10, dtype=np.uint8), gz=True)
    with pytest.raises(DataError, match=r"has shape \(10,\) \(ndim=1\), expected ndim=3$"):
        read_idx(path, ndim=3)
    with pytest.raises(DataError, match=rf"^{path}: md5 .* expected 0{{32}}"):
        read_idx(path, expected_md5="0" * 32)
    good = hashlib.md5(idx_bytes(np.arange(10, dtype=np.uint8))).hexdigest()
    assert read_idx(path, expected_md5=good).shape == (10,)


# ---------------------------------------------------------------------------- find_idx_files
@pytest.mark.parametrize(
    ("sub", "gz"),
    [("", False), ("", True), ("FashionMNIST/raw", True), ("FashionMNIST/raw", False),
     ("fashion-mnist", (True, False, False, True))],
)
def test_find_layouts(tmp_path: Path, sub: str, gz: bool | tuple[bool, ...]) -> None:
    """Flat, torchvision and named-folder layouts are found, with .gz or raw files."""
    written = write_dataset(tmp_path / sub if sub else tmp_path, gz=gz)
    assert find_idx_files(tmp_path, "FashionMNIST", verify=False) == written


def test_find_prefers_first_layout_and_uncompressed(tmp_path: Path) -> None:
    """The data_dir itself wins over the torchvision folder; raw wins over .gz."""
    write_dataset(tmp_path / "FashionMNIST" / "raw", gz=True)
    write_dataset(tmp_path, gz=True)
    raw = write_dataset(tmp_path, gz=False)
    assert find_idx_files(tmp_path, "FashionMNIST", verify=False) == raw


def test_find_md5_mismatch(tmp_path: Path) -> None:
    """Files that are not the reference dataset fail verification, naming the file."""
    write_dataset(tmp_path, gz=True)
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte.gz: md5 of the decompressed content is"):
        find_idx_files(tmp_path, "FashionMNIST", verify=True)
    with pytest.raises(DataError, match="md5"):
        make_dm(tmp_path, verify=True).setup()


def test_find_missing_lists_searched_folders(tmp_path: Path) -> None:
    """One DataError names every searched folder, the expected files and data.download."""
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError) as info:
        find_idx_files(missing, "MNIST")
    message = str(info.value)
    assert "\n" not in message
    for folder in (missing, missing / "MNIST" / "raw", missing / "mnist"):
        assert str(folder) in message
    assert all(name in message for name in FILE_NAMES.values())
    assert "data.download: true" in message


def test_find_partial_folder_is_reported(tmp_path: Path) -> None:
    """A folder with only some of the files is pointed out."""
    write_dataset(tmp_path, gz=True)
    next(tmp_path.glob("t10k-labels*")).unlink()
    with pytest.raises(DataError, match=rf"{tmp_path} has only \['t10k-images"):
        find_idx_files(tmp_path, "FashionMNIST")


def test_download_failure_is_data_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An offline download becomes one DataError naming data.download (no network used)."""
    import torchvision.datasets

    def offline(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz:\n<urlopen error offline>")

    monkeypatch.setattr(torchvision.datasets, "FashionMNIST", offline)
    with pytest.raises(DataError, match=r"^data.download: could not download FashionMNIST .*offline") as info:
        make_dm(tmp_path, download=True).prepare_data()
    assert "\n" not in str(info.value)


def test_unknown_dataset_name() -> None:
    """Only the registered IDX datasets are accepted."""
    with pytest.raises(ConfigError, match="dataset_name must be one of"):
        find_idx_files("data", "CIFAR10")
