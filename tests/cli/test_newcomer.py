"""A newcomer's first runs: data found from anywhere, one clear line per mistake, tidy output.

Bad command-line inputs are rows of :data:`tests.cli.test_bad_input.CASES`; this file holds what
does not fit that table (data search, timing, output files, the other commands).
"""

from __future__ import annotations

import dataclasses
import re
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml

from datamodules import FashionMNISTDataModule, FederatedDataModule, HARDataModule, dirichlet_partition
from datamodules import idx as idx_module
from datamodules.idx import FILE_NAMES, find_idx_files, read_idx
from fedfdp.errors import ConfigError, DataError
from fedfdp.fit import main
from tests.conftest import REPO, SHARED_DATA
from tests.cli.test_cli import TINY
from tests.idx_files import idx_bytes

FMNIST_CONFIG = REPO / "configs" / "fmnist.yaml"
needs_fmnist = pytest.mark.skipif(not (SHARED_DATA / "fashion-mnist").is_dir(),
                                  reason=f"real FashionMNIST not found under {SHARED_DATA}")


def _error_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


@pytest.fixture
def no_fallback_data(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Nothing but the given data_dir holds data: no $FEDFDP_DATA_DIR, an empty cache, no Debian folder."""
    monkeypatch.delenv("FEDFDP_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    spec = idx_module.IDX_DATASETS["FashionMNIST"]
    monkeypatch.setitem(idx_module.IDX_DATASETS, "FashionMNIST", dataclasses.replace(spec, extra_dirs=()))


# ------------------------------------------------------------------ 1. data from any working directory
@needs_fmnist
def test_the_configs_data_dir_is_found_from_any_working_directory(tmp_path, monkeypatch):
    """configs/fmnist.yaml's relative data_dir finds the data from a folder that is not the checkout."""
    data_dir = yaml.safe_load(FMNIST_CONFIG.read_text())["data"]["init_args"]["data_dir"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FEDFDP_DATA_DIR", raising=False)
    files = find_idx_files(data_dir, "FashionMNIST", verify=False)
    assert all(path.resolve().is_relative_to(SHARED_DATA.resolve()) for path in files.values())
    FashionMNISTDataModule(data_dir=data_dir, download=False).prepare_data()


@needs_fmnist
def test_fedfdp_data_dir_environment_variable_is_searched(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDFDP_DATA_DIR", str(SHARED_DATA))
    files = find_idx_files("nowhere", "FashionMNIST", verify=False)
    assert all(path.resolve().is_relative_to(SHARED_DATA.resolve()) for path in files.values())


@pytest.mark.slow
@needs_fmnist
def test_the_main_command_from_another_directory_reaches_the_partition_and_7000_clients_fail_fast(
        tmp_path, monkeypatch, capsys):
    """The README's command, run from elsewhere, loads the real data; 7,000 clients are refused at once."""
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    code = main(["--config", str(FMNIST_CONFIG), "--run_dir", str(tmp_path / "run"), "--trainer.accelerator", "cpu",
                 "--data.init_args.num_clients", "7000", "--data.init_args.verify", "false"])
    elapsed = time.perf_counter() - start
    lines = _error_lines(capsys)
    assert code == 2 and len(lines) == 1, lines
    assert "data.min_size=10" in lines[0] and "impossible" in lines[0]  # the data was found and loaded
    assert elapsed < 60  # was ~2 minutes of partition attempts (the partition alone is timed below)


def test_missing_data_is_one_line_listing_places_names_and_how_to_download(tmp_path, no_fallback_data, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    code = main(["--config", TINY, "--run_dir", str(tmp_path / "run"), "--data", "datamodules.FashionMNISTDataModule",
                 "--data.init_args.data_dir", str(empty), "--data.init_args.download", "false"])
    lines = _error_lines(capsys)
    assert code == 2 and len(lines) == 1, lines
    line = lines[0]
    for folder in (empty, empty / "FashionMNIST" / "raw", empty / "fashion-mnist", tmp_path / "cache" / "fedfdp"):
        assert str(folder) in line
    assert all(name in line for name in FILE_NAMES.values())
    assert "--data.init_args.download true" in line and "FEDFDP_DATA_DIR" in line


def test_automatic_download_offline_fails_fast_with_one_line(tmp_path, no_fallback_data, monkeypatch, capsys):
    """download defaults to auto: offline, the probe fails within seconds and the line says so."""
    monkeypatch.setattr(idx_module, "probe_network", lambda url, timeout=5.0: "offline? cannot reach the mirror")
    start = time.perf_counter()
    code = main(["--config", TINY, "--run_dir", str(tmp_path / "run"), "--data", "datamodules.FashionMNISTDataModule",
                 "--data.init_args.data_dir", str(tmp_path / "none")])
    lines = _error_lines(capsys)
    assert code == 2 and len(lines) == 1, lines
    assert "automatic download (data.download: auto) failed: offline? cannot reach the mirror" in lines[0]
    assert time.perf_counter() - start < 30
    assert FashionMNISTDataModule().download == "auto"


def test_network_probe_never_hangs():
    """A host that cannot answer is given up on within the timeout (no internet is needed)."""
    start = time.perf_counter()
    reason = idx_module.probe_network("http://fedfdp-no-such-host.invalid/", timeout=2.0)
    assert reason is not None and reason.startswith("offline?")
    assert time.perf_counter() - start < 5


# ------------------------------------------------------------------ 2. one clear line per mistake
def test_partition_of_7000_clients_fails_fast():
    labels = np.repeat(np.arange(10), 7000)  # FashionMNIST's 70,000 merged labels
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"^min_size=10 .*impossible in practice"):
        dirichlet_partition(labels, 7000, 0.1, rng=np.random.default_rng(1))
    assert time.perf_counter() - start < 5.0  # ~0.2 s idle; it took 115 s before (a loaded CI needs slack)


def test_dirichlet_suggestion_is_a_valid_setting_that_works():
    """The accepted min_size the error suggests passes the datamodule check and then succeeds."""
    labels = np.repeat(np.arange(4), 50)
    with pytest.raises(ConfigError) as info:
        dirichlet_partition(labels, 8, 0.05, min_size=24, rng=np.random.default_rng(0), max_attempts=30)
    message = str(info.value)
    assert "min_size <= 0" not in message and "min_size <= 1" not in message
    suggested = re.search(r"min_size between 2 and (\d+)", message)
    assert suggested, message
    parts = dirichlet_partition(labels, 8, 0.05, min_size=int(suggested.group(1)), rng=np.random.default_rng(0),
                                max_attempts=30)
    assert min(len(p) for p in parts) >= int(suggested.group(1))
    with pytest.raises(ConfigError) as hopeless:
        dirichlet_partition(labels, 40, 0.01, rng=np.random.default_rng(0))
    assert "min_size between" not in str(hopeless.value) and "partition: iid" in str(hopeless.value)


def test_nan_in_float_idx_file_is_caught_at_load_naming_the_file(tmp_path):
    images = np.zeros((3, 28, 28), dtype=np.float32)
    images[1, 5, 5] = np.nan
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(idx_bytes(images))
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}: 1 NaN/Inf values \(first in sample 1\)"):
        read_idx(path)


def test_nan_in_har_text_file_is_caught_at_load_naming_the_file(tmp_path):
    from tests.cli.test_bad_input import _har_with_nan

    _har_with_nan(tmp_path)
    with pytest.raises(DataError, match=r"body_acc_y_train\.txt: NaN or Inf in 1 row \(first: row 3"):
        HARDataModule(data_dir=str(tmp_path), num_clients=3).setup()


def test_inf_in_a_custom_float_loader_is_caught_at_setup():
    class FloatData(FederatedDataModule):
        num_classes = 2

        def load_arrays(self):
            x = np.random.default_rng(0).random((40, 1, 4, 4)).astype(np.float32)
            x[7, 0, 1, 1] = np.inf
            return x, np.arange(40) % 2, None, None

    with pytest.raises(DataError, match=r"^FloatData data: NaN or Inf in 1 sample \(first: sample 7"):
        FloatData(num_clients=2, partition="iid").setup()


def test_typo_names_the_key_without_listing_unrelated_classes(tmp_path, capsys):
    assert main(["--config", TINY, "--run_dir", str(tmp_path / "run"),
                 "--model.algorithm.init_args.fairnes_weight", "0.5"]) == 2
    (line,) = _error_lines(capsys)
    assert "did you mean 'fairness_weight'?" in line and "shipped" not in line and "Union" not in line


def test_bad_wandb_mode_in_environment_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "bogus")
    assert main(["--config", TINY, "--run_dir", str(tmp_path / "run")]) == 2
    (line,) = _error_lines(capsys)
    assert "WANDB_MODE must be one of" in line


def test_report_of_missing_runs_is_one_line_without_errno(tmp_path, capsys):
    from fedfdp.report import main as report_main

    assert report_main([str(tmp_path / "missing"), str(tmp_path), "--out", str(tmp_path / "cmp")]) == 2
    assert report_main([str(tmp_path / "missing")]) == 2
    with pytest.raises(SystemExit) as exit_info:
        report_main(["--compare"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") and "Errno" not in line for line in err), err
    assert not (tmp_path / "cmp").exists()


def test_paper_table_aggregate_only_without_runs_is_one_line(tmp_path, capsys):
    from fedfdp.experiments.__main__ import main as experiments_main

    assert experiments_main(["paper-table4", "--dataset", "fmnist", "--aggregate-only", "--out", str(tmp_path)]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "nothing to aggregate" in line


# ------------------------------------------------------------------ 3. tidy output
def test_help_shows_only_what_fedfdp_reads(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    for ignored in ("--optimizer", "--lr_scheduler", "--trainer.max_epochs", "--trainer.limit_val_batches",
                    "--trainer.accumulate_grad_batches", "Lightning Trainer command line tool"):
        assert ignored not in out
    for read in ("--model.num_rounds", "--data", "--trainer.callbacks", "--wandb", "--run_dir"):
        assert read in out
    assert len(out.splitlines()) < 460  # was 608 with the ignored optimizer/scheduler/trainer options


@pytest.mark.slow
def test_fresh_run_has_no_log_directory_warning(tmp_path, monkeypatch):
    """A user's default run (W&B offline without an API key) used to warn that the CSV logs' folder is not empty."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["--config", TINY, "--run_dir", str(tmp_path / "run"), "--model.num_rounds", "1",
                     "--wandb", "offline"]) == 0
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "not empty" in m], messages


@pytest.mark.slow
def test_one_wandb_offline_directory_per_run(tmp_path, monkeypatch):
    """Two runs in one process: each writes its own W&B offline run, the second does not log into the first."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("a", "b"):
        assert main(["--config", TINY, "--run_dir", str(tmp_path / name), "--model.num_rounds", "1",
                     "--wandb", "offline"]) == 0
    for name in ("a", "b"):
        run_dir = tmp_path / name
        offline = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
        assert len(offline) == 1, offline
        assert offline[0].endswith("-" + (run_dir / "wandb_run_id").read_text().strip())


@pytest.mark.slow
def test_resumed_offline_run_gets_its_own_wandb_directory_and_id(tmp_path, monkeypatch):
    """W&B cannot resume offline runs: the continuation is its own run, so syncing both loses nothing."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run_dir = tmp_path / "run"
    base = ["--config", TINY, "--run_dir", str(run_dir), "--wandb", "offline"]
    assert main([*base, "--model.num_rounds", "1"]) == 0
    assert main([*base, "--model.num_rounds", "2", "--ckpt_path", "last"]) == 0
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    names = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    assert len(names) == 2, names
    assert sum(n.endswith(f"-{run_id}") for n in names) == 1 and sum(n.endswith(f"-{run_id}-r1") for n in names) == 1


def _experiments(argv: list[str]) -> int:
    from fedfdp.experiments.__main__ import main as experiments_main

    return experiments_main(argv)


@pytest.mark.parametrize("command", ["paper-table4", "finp-table", "rcdpfl-table"])
@pytest.mark.parametrize("seeds", [["0", "1", "2"], ["0,1,2"]], ids=["spaces", "commas"])
@pytest.mark.parametrize("dry_run", ["--dry-run", "--dry_run"])
def test_every_experiments_command_takes_the_same_seeds_and_dry_run(tmp_path, monkeypatch, capsys, command, seeds,
                                                                    dry_run):
    """Same option forms everywhere; a dry run prints one fedfdp.fit command per run and writes nothing."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    extra = {"paper-table4": ["--dataset", "fmnist", "--methods", "FedFDP"], "finp-table": ["--rows", "baseline"],
             "rcdpfl-table": ["--methods", "rcdpfl"]}[command]
    assert _experiments([command, *extra, "--seeds", *seeds, "--out", str(out), dry_run]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if "fedfdp.fit" in line]
    assert len(commands) == 3, commands
    assert not out.exists()


def test_report_plots_have_integer_round_ticks(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from fedfdp import report

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    report._line_plot(tmp_path / "acc.png", "accuracy", "accuracy", {"run": [(1, 0.5), (2, 0.6)]}, False)
    ticks = figures[0].axes[0].get_xticks()
    assert len(ticks) and all(float(t).is_integer() for t in ticks), ticks
    plt.close("all")


def test_readme_refers_only_to_files_in_the_repository():
    readme = (REPO / "README.md").read_text()
    assert "shared/spec" not in readme
    for target in re.findall(r"\]\(([^)#\s]+)", readme):
        if not target.startswith(("http://", "https://")):
            assert (REPO / target).exists(), target
    for path in re.findall(r"`((?:fedfdp|callbacks|datamodules|configs|docs|tests|benchmarks)/[\w./-]+)`", readme):
        assert (REPO / path).exists(), path
