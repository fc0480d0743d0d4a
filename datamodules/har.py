"""Human activity recognition: UCI HAR (every subject a client) and a synthetic HAR-like generator.

UCI HAR (Anguita et al. 2013; FinP spec §4.1): 30 subjects, 6 activities, windows of 128 readings
(2.56 s at 50 Hz, 50 % overlap) of 9 inertial channels. :class:`HARDataModule` reads the dataset's
own text files::

    <data_dir>/[UCI HAR Dataset/]{train,test}/Inertial Signals/{body_acc,body_gyro,total_acc}_{x,y,z}_{split}.txt
    <data_dir>/[UCI HAR Dataset/]{train,test}/{y,subject}_{split}.txt

merges the official splits, makes every subject one client (``num_clients < 30`` picks subjects at
random with ``partition_seed``) and splits each subject's windows ``train_fraction`` / rest
(paper preset 70/30, spec A-8). Windows are stored as ``(n, 9, 1, 128)`` float32 so that the
framework's ``(C, H, W)`` shape convention holds; they are not re-normalised (the signals are
already in units of g and rad/s, O(1)). :class:`SyntheticHARDataModule` generates data of the same
shape (spec §7.2): per-activity waveform families plus a per-subject gain, offset, phase and noise
level, so a source inference attack has a subject signature to exploit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from datamodules.federated import ClientSplits, FederatedDataModule, check_fields, check_finite
from datamodules.paths import data_roots
from datamodules.partition import train_test_split_indices
from fedfdp.errors import DataError

__all__ = ["HAR_SIGNALS", "HARDataModule", "SyntheticHARDataModule", "read_uci_har"]

HAR_SIGNALS = tuple(f"{kind}_{axis}" for kind in ("body_acc", "body_gyro", "total_acc") for axis in "xyz")
"""The 9 inertial-signal files, in channel order."""


def _root(data_dir: str | Path) -> Path:
    """The UCI HAR folder under the first root of :func:`datamodules.paths.data_roots` that holds it."""
    searched = [cand for base in data_roots(data_dir) for cand in (base / "UCI HAR Dataset", base)]
    for cand in searched:
        if (cand / "train" / "Inertial Signals").is_dir():
            return cand
    raise DataError(f"data.data_dir: no UCI HAR files in {', '.join(map(str, searched))} (expected "
                    "'[UCI HAR Dataset/]{train,test}/Inertial Signals/*_{train,test}.txt'); download the dataset "
                    "from the UCI repository and point data.data_dir (or FEDFDP_DATA_DIR) at it")


def _read_txt(path: Path) -> np.ndarray:
    if not path.exists():
        raise DataError(f"{path}: missing UCI HAR file")
    try:
        table = np.loadtxt(path, dtype=np.float64, ndmin=2)
    except ValueError as err:
        raise DataError(f"{path}: not a whitespace-separated numeric table ({err})") from err
    check_finite(table, str(path), unit="row")
    return table


def read_uci_har(data_dir: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(windows float32 (N, 9, 128), labels int64 in [0, 6), subjects int64)`` of train ∪ test."""
    root = _root(data_dir)
    xs, ys, ss = [], [], []
    for split in ("train", "test"):
        chans = [_read_txt(root / split / "Inertial Signals" / f"{sig}_{split}.txt") for sig in HAR_SIGNALS]
        y = _read_txt(root / split / f"y_{split}.txt").reshape(-1).astype(np.int64) - 1
        s = _read_txt(root / split / f"subject_{split}.txt").reshape(-1).astype(np.int64)
        shapes = {c.shape for c in chans}
        if len(shapes) != 1 or next(iter(shapes))[0] != len(y) or len(s) != len(y):
            raise DataError(f"{root / split}: signal files {sorted(shapes)}, {len(y)} labels and {len(s)} subjects "
                            "must agree in the number of windows")
        if len(y) and (y.min() < 0 or y.max() > 5):
            raise DataError(f"{root / split / f'y_{split}.txt'}: activity labels must be in 1..6, got "
                            f"{y.min() + 1}..{y.max() + 1}")
        xs.append(np.stack(chans, axis=1).astype(np.float32))
        ys.append(y)
        ss.append(s)
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(ss)


class HARDataModule(FederatedDataModule):
    """UCI HAR with one client per subject.

    Args:
        data_dir: folder holding ``UCI HAR Dataset/`` (or its contents).
        num_clients: subjects used (all 30 by default; fewer are drawn with ``partition_seed``).
        train_fraction: per-subject training fraction (paper 0.7; the authors' code 0.8).
        partition_seed: seed of the subject choice and of the per-subject split.
        val_fraction: fraction of each subject's training windows held out as its validation split
            (see :class:`~datamodules.federated.FederatedDataModule`; 0: none).
    """

    num_classes: int = 6
    mean: tuple[float, ...] = (0.0,) * 9
    std: tuple[float, ...] = (1.0,) * 9

    def __init__(self, *, data_dir: str = "data", num_clients: int = 30, train_fraction: float = 0.7,
                 partition_seed: int = 1, val_fraction: float = 0.0) -> None:
        super().__init__(data_dir=data_dir, num_clients=num_clients, partition="iid", train_fraction=train_fraction,
                         partition_seed=partition_seed, val_fraction=val_fraction)
        self.subjects = np.zeros(0, dtype=np.int64)

    def load_windows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(windows (N, C, T), labels, subject ids)``."""
        return read_uci_har(self.data_dir)

    def setup(self, stage: str | None = None) -> None:
        """Load, choose subjects, split each subject's windows into train/test (once)."""
        if self._store is not None:
            return
        x, y, subj = self.load_windows()
        check_finite(x, f"{type(self).__name__} data")
        subjects = np.unique(subj)
        if self.num_clients > len(subjects):
            raise DataError(f"data.num_clients={self.num_clients} exceeds the {len(subjects)} subjects in the data")
        rng = np.random.default_rng(self.partition_seed)
        chosen = subjects if self.num_clients == len(subjects) else np.sort(rng.choice(subjects, self.num_clients,
                                                                                      replace=False))
        self.subjects = chosen
        self._indices = [train_test_split_indices(np.flatnonzero(subj == s), self.train_fraction, rng) for s in chosen]
        self._hold_out_validation()
        windows = torch.from_numpy(np.ascontiguousarray(x[:, :, None, :], dtype=np.float32))
        labels = torch.from_numpy(y.astype(np.int64))
        self._input_shape = (int(x.shape[1]), 1, int(x.shape[2]))
        self._store = tuple(ClientSplits.from_clients([(windows[idx], labels[idx]) for idx in parts])  # type: ignore[assignment]
                            for parts in zip(*self._indices))
        if self._val_indices:
            self._val_store = ClientSplits.from_clients([(windows[idx], labels[idx]) for idx in self._val_indices])
        self.train_sizes = np.array([len(tr) for tr, _ in self._indices], dtype=np.int64)
        self.test_sizes = np.array([len(te) for _, te in self._indices], dtype=np.int64)
        if self._pending_state is not None:
            pending, self._pending_state = self._pending_state, None
            self.load_state_dict(pending)

    def partition_config(self) -> dict[str, Any]:
        """Base settings plus the chosen subjects."""
        return {**super().partition_config(), "subjects": [int(s) for s in self.subjects]}


class SyntheticHARDataModule(HARDataModule):
    """HAR-like windows for fast CPU runs (spec §7.2 ``synthetic_har``); no files needed.

    Activity ``a`` is a sum of two sinusoids with activity-specific frequencies/amplitudes per
    channel; subject ``s`` multiplies by a gain, adds an offset and a phase shift and its own noise
    level. Per-subject, per-activity counts are ``randint(lo, hi)``.

    Args:
        num_clients: subjects (= clients).
        windows_per_activity: ``(lo, hi)`` bounds of the per-subject, per-activity window count.
        seq_len: window length T.
        channels: number of channels.
        seed: seed of the generated data.
        train_fraction: per-subject training fraction.
        partition_seed: seed of the per-subject split.
        val_fraction: fraction of each subject's training windows held out for validation (0: none).
    """

    def __init__(self, *, num_clients: int = 10, windows_per_activity: tuple[int, int] = (20, 30), seq_len: int = 128,
                 channels: int = 9, seed: int = 0, train_fraction: float = 0.7, partition_seed: int = 1,
                 val_fraction: float = 0.0) -> None:
        super().__init__(data_dir="synthetic", num_clients=num_clients, train_fraction=train_fraction,
                         partition_seed=partition_seed, val_fraction=val_fraction)
        lo, hi = (tuple(windows_per_activity) + (0, 0))[:2]
        check_fields(windows_per_activity=(windows_per_activity, 1 <= lo <= hi, "two integers 1 <= lo <= hi"),
                     seq_len=(seq_len, seq_len >= 8, "an integer >= 8"),
                     channels=(channels, channels >= 1, "an integer >= 1"))
        self.windows_per_activity, self.seq_len, self.channels, self.seed = (int(lo), int(hi)), seq_len, channels, seed
        self.mean, self.std = (0.0,) * channels, (1.0,) * channels

    def load_windows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Generate ``(windows (N, C, T), labels, subject ids 1..K)``."""
        rng = np.random.default_rng(self.seed)
        c, t = self.channels, np.arange(self.seq_len) / 50.0
        freq = rng.uniform(0.5, 3.0, size=(6, c, 2))
        amp = rng.uniform(0.2, 1.0, size=(6, c, 2))
        xs, ys, ss = [], [], []
        for subject in range(1, self.num_clients + 1):
            gain, offset = rng.uniform(0.7, 1.3, size=c), rng.normal(0.0, 0.3, size=c)
            phase, noise = rng.uniform(0, 2 * np.pi, size=c), rng.uniform(0.1, 0.4)
            for activity in range(6):
                n = int(rng.integers(self.windows_per_activity[0], self.windows_per_activity[1] + 1))
                start = rng.uniform(0, 2 * np.pi, size=(n, 1, 1))
                arg = 2 * np.pi * freq[activity][None, :, :, None] * t + (start + phase[None, :, None])[:, :, None, :]
                wave = (amp[activity][None, :, :, None] * np.sin(arg)).sum(2)
                xs.append(gain[None, :, None] * wave + offset[None, :, None] + noise * rng.standard_normal(wave.shape))
                ys.append(np.full(n, activity, dtype=np.int64))
                ss.append(np.full(n, subject, dtype=np.int64))
        return np.concatenate(xs).astype(np.float32), np.concatenate(ys), np.concatenate(ss)

    def partition_config(self) -> dict[str, Any]:
        """Base settings plus the generator's."""
        return {**super().partition_config(), "seed": self.seed,
                "windows_per_activity": list(self.windows_per_activity), "seq_len": self.seq_len,
                "channels": self.channels}
