"""Where dataset files are looked for: one rule for every datamodule, from any working directory.

The folders searched for a dataset (:func:`data_roots`), in order; the first folder that holds
every file of the dataset wins, and the folder used is logged:

1. ``data_dir`` as given; a relative path is relative to the working directory;
2. ``$FEDFDP_DATA_DIR``, when that environment variable is set;
3. a relative ``data_dir`` taken relative to the fedfdp checkout (the folder holding ``configs/``),
   so the shipped configs' ``data_dir: ../shared/data`` names the same folder from any working
   directory;
4. ``~/.cache/fedfdp`` (a per-user place to drop dataset files);
5. the dataset's system folders (Debian's ``/usr/share/datasets/fashion-mnist`` for FashionMNIST).

Each datamodule also looks in its usual sub-folders of every root (torchvision's
``<root>/FashionMNIST/raw``, ``<root>/fashion-mnist``, ``<root>/cifar-10-batches-py``, ...).
Downloads (``data.download: auto`` or ``true``) go to :func:`download_root`:
``$FEDFDP_DATA_DIR`` when set, otherwise ``data_dir`` relative to the working directory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from os import PathLike
from pathlib import Path

__all__ = ["CHECKOUT", "DATA_DIR_ENV", "data_roots", "download_root"]

#: Environment variable naming an extra data folder (searched second, and where downloads go).
DATA_DIR_ENV = "FEDFDP_DATA_DIR"
#: The fedfdp checkout (the folder holding ``configs/``), or ``None`` for an installed package.
CHECKOUT: Path | None = Path(__file__).resolve().parents[1]
if not (CHECKOUT / "configs").is_dir():
    CHECKOUT = None


def _user_cache() -> Path:
    """``~/.cache/fedfdp`` (``$XDG_CACHE_HOME/fedfdp`` when that is set)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fedfdp"


def data_roots(data_dir: str | PathLike[str], extra: Iterable[Path] = ()) -> list[Path]:
    """The folders searched for dataset files, in search order, without duplicates.

    Args:
        data_dir: The configured ``data.data_dir``.
        extra: Dataset-specific system folders, searched last.

    Returns:
        Absolute paths (they need not exist).
    """
    given = Path(data_dir).expanduser()
    roots = [Path.cwd() / given]
    if os.environ.get(DATA_DIR_ENV):
        roots.append(Path(os.environ[DATA_DIR_ENV]).expanduser())
    if not given.is_absolute() and CHECKOUT is not None:
        roots.append(CHECKOUT / given)
    roots += [_user_cache(), *extra]
    unique: dict[str, Path] = {}
    for root in roots:
        unique.setdefault(os.path.normpath(os.path.abspath(root)), root)
    return [Path(key) for key in unique]


def download_root(data_dir: str | PathLike[str]) -> Path:
    """Where a download puts the files: ``$FEDFDP_DATA_DIR`` when set, else ``data_dir`` (cwd-relative)."""
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env).expanduser() if env else Path(os.path.abspath(Path(data_dir).expanduser()))
