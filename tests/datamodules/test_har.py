"""HAR datamodules (UCI text format written here, synthetic generator) and the TCN / GroupNorm ResNet."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules import HARDataModule, SyntheticHARDataModule
from datamodules.har import HAR_SIGNALS
from fedfdp import ClientModule
from fedfdp.errors import DataError
from fedfdp.models import TCN, ResNetGN
from fedfdp.privacy.clipping import FlatClip
from fedfdp.types import LocalBatch


def write_uci_har(root: Path, subjects: dict[str, list[int]], per_subject: int = 12, seed: int = 0) -> None:
    """Tiny files in the UCI HAR layout: ``<root>/UCI HAR Dataset/{split}/...``, 128 values per row."""
    rng = np.random.default_rng(seed)
    for split, subs in subjects.items():
        folder = root / "UCI HAR Dataset" / split
        (folder / "Inertial Signals").mkdir(parents=True)
        n = per_subject * len(subs)
        for sig in HAR_SIGNALS:
            rows = rng.normal(0, 0.5, size=(n, 128))
            (folder / "Inertial Signals" / f"{sig}_{split}.txt").write_text(
                "\n".join("  " + "  ".join(f"{v: .7e}" for v in row) for row in rows) + "\n")
        labels = np.tile(np.arange(1, 7), n // 6 + 1)[:n]
        (folder / f"y_{split}.txt").write_text("\n".join(str(v) for v in labels) + "\n")
        (folder / f"subject_{split}.txt").write_text("\n".join(str(s) for s in np.repeat(subs, per_subject)) + "\n")


def test_uci_har_loader_makes_every_subject_a_client(tmp_path):
    write_uci_har(tmp_path, {"train": [1, 3, 5], "test": [2, 4]})
    dm = HARDataModule(data_dir=str(tmp_path), num_clients=5, train_fraction=0.75)
    dm.setup()
    assert dm.subjects.tolist() == [1, 2, 3, 4, 5] and dm.input_shape == (9, 1, 128)
    assert dm.train_sizes.tolist() == [9] * 5 and dm.test_sizes.tolist() == [3] * 5
    x, y = dm.client_train(0)
    assert x.shape == (9, 9, 1, 128) and x.dtype == torch.float32 and 0 <= int(y.min()) and int(y.max()) <= 5
    xs = np.loadtxt(tmp_path / "UCI HAR Dataset/train/Inertial Signals/body_gyro_y_train.txt")
    # subject 1 is in the train files; channel 4 is body_gyro_y: every window is one of that file's rows
    assert all(np.isclose(xs, x[i, 4, 0].numpy(), atol=1e-6).all(axis=1).any() for i in range(len(y)))
    sub = HARDataModule(data_dir=str(tmp_path), num_clients=3)
    sub.setup()
    assert len(sub.subjects) == 3 and sub.fingerprint() != dm.fingerprint()


def test_uci_har_loader_reports_missing_and_inconsistent_files(tmp_path):
    with pytest.raises(DataError, match="no UCI HAR files"):
        HARDataModule(data_dir=str(tmp_path)).setup()
    write_uci_har(tmp_path, {"train": [1], "test": [2]})
    (tmp_path / "UCI HAR Dataset/test/y_test.txt").write_text("1\n2\n")
    with pytest.raises(DataError, match="must agree"):
        HARDataModule(data_dir=str(tmp_path), num_clients=2).setup()


def test_synthetic_har_is_seeded_and_subject_specific():
    a, b = SyntheticHARDataModule(num_clients=4, seq_len=32), SyntheticHARDataModule(num_clients=4, seq_len=32)
    a.setup()
    b.setup()
    assert torch.equal(a.client_train(2)[0], b.client_train(2)[0]) and a.num_classes == 6
    sizes = a.train_sizes + a.test_sizes
    assert ((sizes >= 6 * 20) & (sizes <= 6 * 30)).all()
    means = torch.stack([a.client_train(c)[0].mean(dim=(0, 2, 3)) for c in range(4)])
    assert means.std(0).mean() > 0.05  # per-subject offsets: a signature for the SIA


def test_tcn_shapes_causal_option_and_dp_step_through_vmap():
    x = torch.randn(5, 9, 1, 128)
    assert TCN()(x).shape == (5, 6) and TCN(causal=True)(x.flatten(2)).shape == (5, 6)
    assert TCN().fc.in_features == 64 * 30  # the authors' Linear(64·30 → classes)
    client = ClientModule(TCN(width=4, seq_len=32))
    before = client.get_flat_params()
    client.training_step(LocalBatch(x=torch.randn(4, 9, 1, 32), y=torch.randint(0, 6, (4,)), lr=0.1,
                                    clip_rule=FlatClip(1.0), noise_multiplier=0.0, denominator=4.0,
                                    generator=torch.Generator().manual_seed(0)))
    assert not torch.equal(before, client.get_flat_params())


def test_groupnorm_resnet_has_no_batchnorm_and_trains_per_sample():
    net = ResNetGN(depth=8, base_width=4, groups=2)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in net.modules())
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    client = ClientModule(net)
    client.training_step(LocalBatch(x=torch.randn(3, 3, 16, 16), y=torch.tensor([0, 1, 2]), lr=0.1,
                                    clip_rule=FlatClip(1.0), noise_multiplier=0.0, denominator=3.0,
                                    generator=torch.Generator().manual_seed(0)))
    from fedfdp.errors import ConfigError

    with pytest.raises(ConfigError, match="depth must be 6n"):
        ResNetGN(depth=10)
