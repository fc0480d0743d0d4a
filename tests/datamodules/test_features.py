"""The ScatterNet front end (datamodules.features) and the models on its features (fedfdp.models.scatter)."""

from __future__ import annotations

import pytest
import torch

from datamodules import SyntheticDataModule
from datamodules.features import ScatteringFeatures
from fedfdp.errors import ConfigError, DataError
from fedfdp.models import ScatterCNN, ScatterLinear
from fedfdp.grad_sample.engine import GhostEngine, ghost_unsupported_reason
from tests.helpers import assert_matches, microbatch_grads


def test_scattering_shape_channels_and_constant_image():
    """K = 1 + J·L + L²·J(J−1)/2 per input channel; a constant image keeps its value in the low-pass
    (zeroth-order) channel and gives zero wavelet coefficients (wavelets have zero mean)."""
    features = ScatteringFeatures(J=2, L=8)
    assert features.channels_per_input_channel == 81
    assert features.output_shape((1, 28, 28)) == (81, 7, 7)
    assert features.output_shape((3, 32, 32)) == (243, 8, 8)
    out = features(torch.full((2, 1, 16, 16), 0.7))
    assert out.shape == (2, 81, 4, 4) and out.dtype == torch.float32
    torch.testing.assert_close(out[:, 0], torch.full((2, 4, 4), 0.7), rtol=0, atol=1e-4)
    assert out[:, 1:].abs().max() < 1e-5
    assert ScatteringFeatures(J=1, L=4).output_shape((1, 8, 8)) == (5, 4, 4)


def test_scattering_is_per_sample_and_deterministic():
    """Each image's features depend on that image alone (no statistic across samples is released)
    and not on the batching."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(7, 2, 16, 16, generator=generator)
    batched = ScatteringFeatures(J=2, L=8, batch_size=3)(images)
    assert batched.shape == (7, 162, 4, 4)
    torch.testing.assert_close(ScatteringFeatures(J=2, L=8, batch_size=1024)(images), batched, rtol=0, atol=0)
    changed = images.clone()
    changed[0] = torch.randn(2, 16, 16, generator=generator)
    others = ScatteringFeatures(J=2, L=8)(changed)
    torch.testing.assert_close(others[1:], batched[1:], rtol=0, atol=0)
    assert not torch.allclose(others[0], batched[0])


@pytest.mark.parametrize("kwargs, field", [({"J": 0}, "J"), ({"L": 1.5}, "L"), ({"batch_size": 0}, "batch_size")])
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=rf"^data\.features\.{field} must be an integer >= 1"):
        ScatteringFeatures(**kwargs)


@pytest.mark.slow
def test_datamodule_serves_the_features_of_its_own_images():
    """With ``features`` every client's split is the scattering of the same normalised images, in
    the same partition; the fingerprint tells the two inputs apart."""
    kwargs = {"num_samples": 300, "num_clients": 3, "image_shape": (1, 16, 16), "num_classes": 4, "val_fraction": 0.2}
    pixels = SyntheticDataModule(**kwargs)
    scattered = SyntheticDataModule(features=ScatteringFeatures(J=2, L=8, batch_size=64), **kwargs)
    pixels.setup()
    scattered.setup()
    assert scattered.input_shape == (81, 4, 4)
    assert scattered.train_sizes.tolist() == pixels.train_sizes.tolist()
    transform = ScatteringFeatures(J=2, L=8)
    for split in ("client_train", "client_test", "client_val"):
        for cid in range(3):
            x_pix, y_pix = getattr(pixels, split)(cid)
            x_sc, y_sc = getattr(scattered, split)(cid)
            assert torch.equal(y_sc, y_pix)
            torch.testing.assert_close(x_sc, transform(x_pix), rtol=0, atol=1e-6)
    x, _, _, read = scattered.pooled_raw("test")
    assert x.shape[1:] == (81, 4, 4) and read(x) is x
    assert scattered.partition_config()["features"] == {"name": "scattering", "J": 2, "L": 8}
    assert scattered.fingerprint() != pixels.fingerprint()


def test_image_sides_not_divisible_by_two_to_the_j_fail_in_one_line():
    dm = SyntheticDataModule(num_samples=60, num_clients=2, image_shape=(1, 18, 18), features=ScatteringFeatures(J=2))
    with pytest.raises(DataError, match=r"^data\.features: ScatteringFeatures\(J=2\) needs image sides divisible by 4"):
        dm.setup()
    with pytest.raises(ConfigError, match=r"^data\.features must be null or a datamodules\.features\.Scattering"):
        SyntheticDataModule(features="scattering")  # type: ignore[arg-type]


@pytest.mark.parametrize("make_net", [lambda: ScatterLinear(in_channels=18, num_classes=5, image_size=4, groups=6),
                                      lambda: ScatterCNN(in_channels=18, num_classes=5, image_size=4, groups=6,
                                                         width=4, hidden=8)], ids=["linear", "cnn"])
def test_scatter_models_get_exact_ghost_per_sample_gradients(make_net):
    torch.manual_seed(0)
    net = make_net()
    assert ghost_unsupported_reason(net) is None
    x, y = torch.randn(6, 18, 4, 4), torch.randint(0, 5, (6,))
    assert_matches(GhostEngine(net).compute(x, y), microbatch_grads(net, x, y), torch.rand(6))


def test_scatter_model_shapes_and_errors():
    assert ScatterLinear()(torch.randn(2, 81, 7, 7)).shape == (2, 10)
    assert ScatterCNN()(torch.randn(2, 81, 7, 7)).shape == (2, 10)
    assert sum(p.numel() for p in ScatterLinear().parameters()) == 81 * 49 * 10 + 10
    with pytest.raises(ValueError, match="groups must divide the 81 feature channels, got 4"):
        ScatterLinear(groups=4)
    with pytest.raises(ValueError, match="image_size must be >= 4"):
        ScatterCNN(image_size=3)


def test_cache_returns_the_features_it_stored_and_recovers_from_a_bad_file(tmp_path, monkeypatch, caplog):
    generator = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (20, 1, 8, 8), dtype=torch.uint8, generator=generator).numpy()

    def normalize(x):
        return x.to(torch.float32) / 255

    features = ScatteringFeatures(J=1, L=4, cache_dir=str(tmp_path / "cache"))
    computed = features.extract(raw, normalize, "test")
    files = list((tmp_path / "cache").iterdir())
    assert len(files) == 1 and files[0].suffix == ".pt"
    torch.testing.assert_close(computed, ScatteringFeatures(J=1, L=4)(normalize(torch.from_numpy(raw))),
                               rtol=0, atol=0)

    def fail(self, images):
        raise AssertionError("recomputed although cached")

    with monkeypatch.context() as patch:
        patch.setattr(ScatteringFeatures, "__call__", fail)
        assert torch.equal(features.extract(raw, normalize, "test"), computed)
    # another input, normalisation or J gets a file of its own
    features.extract(raw[:10], normalize, "test")
    features.extract(raw, normalize, "other")
    ScatteringFeatures(J=2, L=4, cache_dir=str(tmp_path / "cache")).extract(raw, normalize, "test")
    assert len(list((tmp_path / "cache").iterdir())) == 4
    files[0].write_bytes(b"not a tensor")
    assert torch.equal(features.extract(raw, normalize, "test"), computed)
    assert "unreadable" in caplog.text


@pytest.mark.parametrize("make_net", [ScatterLinear, ScatterCNN])
def test_normalising_at_extraction_is_the_models_group_norm(make_net):
    """``ScatteringFeatures(group_norm=27)`` + ``groups=None`` is the model's own GroupNorm, computed once."""
    torch.manual_seed(0)
    images = torch.rand(6, 1, 28, 28)
    raw = ScatteringFeatures()(images)
    normalised = ScatteringFeatures(group_norm=27)(images)
    inside = make_net(groups=27)
    outside = make_net(groups=None)
    outside.load_state_dict(inside.state_dict())
    torch.testing.assert_close(outside(normalised), inside(raw), rtol=1e-5, atol=1e-6)
    assert ScatteringFeatures(group_norm=27).describe()["group_norm"] == 27
    assert "group_norm" not in ScatteringFeatures().describe()  # earlier fingerprints and caches unchanged
    with pytest.raises(ConfigError, match="group_norm must divide the 81"):
        ScatteringFeatures(group_norm=4)(images)
