"""Test-wide settings: passive OpenMP waiting, W&B disabled, small shared fixtures."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported
os.environ["WANDB_MODE"] = "disabled"
os.environ.setdefault("WANDB_SILENT", "true")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _deterministic_threads():
    """Keep tests single-threaded-friendly and deterministic."""
    torch.use_deterministic_algorithms(False)
    yield


def pytest_addoption(parser):
    parser.addoption("--flower-all-algorithms", action="store_true",
                     help="also deploy every algorithm over real Flower processes (flower_all marker; "
                          "about 2 min each here), not only the three of every test run")


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu`` tests without CUDA and ``flower_all`` tests without ``--flower-all-algorithms``;
    deselect the few thousand ``input_fuzz`` tests unless the marker expression names them
    (``pytest -m input_fuzz tests/cli/test_input_generator.py``): running each only to skip it cost
    seconds of every test run."""
    skips = []
    if not torch.cuda.is_available():
        skips.append(("gpu", pytest.mark.skip(reason="needs a CUDA device")))
    if not config.getoption("--flower-all-algorithms"):
        skips.append(("flower_all", pytest.mark.skip(reason="every algorithm over real processes: "
                                                            "pytest --flower-all-algorithms -m flower")))
    for marker in ("input_fuzz", "file_fuzz", "process_fuzz"):
        if marker not in (config.getoption("-m") or ""):
            fuzz = [item for item in items if marker in item.keywords]
            if fuzz:
                config.hook.pytest_deselected(items=fuzz)
                items[:] = [item for item in items if marker not in item.keywords]
    for item in items:
        for keyword, skip in skips:
            if keyword in item.keywords:
                item.add_marker(skip)


def saved_run(tmp_path: Path, config: Path, *args: str, name: str = "saved") -> Path:
    """``tmp_path/name``: a run directory holding the ``config.yaml`` that ``fedfdp.fit --config config
    args`` saves (the resolved config; parsed and built in this process, nothing fitted)."""
    import yaml

    from fedfdp.cli.parser import build_cli

    cli = build_cli(["--config", str(config), "--run_dir", str(tmp_path / f"{name}.built"), *args])
    run = tmp_path / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(cli._dump(cli.config), sort_keys=False))
    return run
