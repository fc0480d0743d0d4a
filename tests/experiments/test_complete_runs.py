"""The committed complete runs (docs/complete_runs): each run's ε follows from its own privacy
ledger and stays within its target, and the tables of docs/results/ are what the tabulate script
prints from those files (the docs cannot drift from the data)."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import runpy
import shlex
from collections import defaultdict

import pytest
import yaml

from fedfdp.privacy.accounting import DPEvent, epsilon_of
from tests.conftest import REPO
from tests.helpers import complete_runs_index

RUNS = sorted((REPO / "docs" / "complete_runs").glob("*/*/seed*/summary.json"))
RESULTS_DIR = REPO / "docs" / "results"


class _Pages:
    """The results pages (docs/results/*.md) read as one text."""

    def read_text(self) -> str:
        return "\n".join(page.read_text() for page in sorted(RESULTS_DIR.glob("*.md")))


RESULTS = _Pages()


def _ledger(run_dir):
    path = run_dir / "privacy_ledger.jsonl.gz"
    return [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("summary_path", RUNS, ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}")
def test_a_committed_runs_epsilon_is_its_ledgers_and_within_the_target(summary_path):
    summary = json.loads(summary_path.read_text())
    assert summary.get("status", "completed") in ("completed", "budget_spent")  # only complete runs are committed
    if summary.get("epsilon") is None:  # a non-private baseline (e.g. local-only training without DP)
        assert summary["dp_valid"] is False and not (summary_path.parent / "privacy_ledger.jsonl.gz").exists()
        return
    records = _ledger(summary_path.parent)
    per_client = defaultdict(list)
    for r in records:
        per_client[r["client"]].append(DPEvent(noise_multiplier=r["sigma"], sample_rate=r["q"], steps=r["steps"]))
    epsilon = max(epsilon_of(events, summary["delta"]) for events in per_client.values())
    assert epsilon == pytest.approx(summary["epsilon"], rel=1e-9)
    target = summary["target_epsilon"]  # None: a fixed round count (e.g. FinP's 20), whose spent ε is reported
    assert summary["dp_valid"] and (target is None or epsilon <= target)
    assert max(r["round"] for r in records) + 1 == summary["rounds_run"]
    assert all(r["sigma"] > 0 for r in records)  # every release noised


@pytest.mark.slow
def test_results_tables_are_what_tabulate_prints_from_the_committed_runs(monkeypatch, tmp_path):
    text = RESULTS.read_text()
    commands = [line.strip().rstrip("\\").strip() for line in text.splitlines()
                if line.strip().startswith("python docs/complete_runs/tabulate.py")]
    assert commands, "docs/results/ shows no tabulate command"
    monkeypatch.chdir(REPO)
    main = runpy.run_path(str(REPO / "docs" / "complete_runs" / "tabulate.py"))["main"]
    for n, command in enumerate(commands):
        argv = shlex.split(command)[2:]
        if "--plot" in argv:  # drawn into tmp_path, not over the committed figure
            argv[argv.index("--plot") + 1] = str(tmp_path / f"plot{n}.png")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(argv)
        rows = [line for line in out.getvalue().splitlines() if line.startswith("| ") and "---" not in line][1:]
        assert rows
        for row in rows:
            label, cells = row.split(" | ", 1)
            assert cells in text, f"docs/results/ does not show tabulate's row for {label}"
        if "--plot" in argv:
            assert (tmp_path / f"plot{n}.png").stat().st_size > 10_000


def _committed_study(best_path, tmp_path):
    """(study name, its best.json, the Optuna study) of a committed study folder, loaded from a copy
    of its study.db (loading a study may write to its file)."""
    import shutil

    import optuna

    name = best_path.parent.name
    db = tmp_path / "study.db"
    shutil.copy(best_path.parent / "study.db", db)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return name, json.loads(best_path.read_text()), optuna.load_study(study_name=name, storage=f"sqlite:///{db}")


STUDIES = sorted((REPO / "docs" / "complete_runs" / "tuning" / "equal_budget").glob("*/best.json"))
#: Each finished equal-budget study: the config its table rows name and the committed runs of it.
#: A study whose best trial is trial 0 (the shipped config) keeps the shipped config and its rows.
WINNER_ROWS = {
    "local_dp": ("configs/tuned/fmnist_local_dp.yaml", "issue23_fmnist10/local_dp_tuned"),
    "dpfedavg": ("configs/tuned/fmnist_dpfedavg.yaml", "table4_fmnist/dpfedavg_tuned"),
    "dpfedavg_prior": ("configs/fmnist_dpfedavg_prior.yaml", "issue23_fmnist10/dpfedavg_prior"),
    "ditto_dp_private": ("configs/tuned/fmnist_ditto_dp_private.yaml", "issue23_fmnist10/ditto_dp_private_tuned"),
    "fedfdp": ("configs/tuned/fmnist_fedfdp_8trials.yaml", "issue23_fmnist10/fedfdp_8trials"),
    "local": ("configs/tuned/fmnist_local_8trials.yaml", "issue23_fmnist10/local_8trials"),
    "dpfedavg_finetune": ("configs/tuned/fmnist_dpfedavg_finetune_8trials.yaml", "issue23_fmnist10/dpfedavg_finetune_8trials"),
    **{f"{m}_scatter": (f"configs/tuned/fmnist_{m}_scatter.yaml", f"issue23_fmnist10/{m}_scatter_tuned")
       for m in ("local_dp", "dpfedavg", "dpfedavg_prior", "dpfedavg_finetune")},
}


def _dotted(config: dict, key: str):
    for part in key.split("."):
        config = config[part]
    return config


def _today_value(config: dict, key: str):
    """The value of a committed study's parameter ``key`` (stored in the spelling before ``privacy=``)
    in ``config`` (a shipped config, or a committed run's saved one), both read in today's spelling
    (:mod:`fedfdp.algorithms.retired`): a mechanism option of a private algorithm is its privacy node's."""
    from fedfdp.algorithms.retired import upgrade_config, upgrade_key

    config = upgrade_config(config)
    private = isinstance(config["model"]["algorithm"].get("init_args", {}).get("privacy"), dict)
    return _dotted(config, upgrade_key(key) if private else key)


def test_every_finished_study_names_the_rows_of_its_winner():
    assert {p.parent.name for p in STUDIES} == set(WINNER_ROWS)


@pytest.mark.parametrize("best_path", STUDIES, ids=lambda p: p.parent.name)
def test_an_equal_budget_winner_is_its_studys_best_trial_and_its_rows_run_it(best_path, tmp_path):
    """A row called "8-trial tuned" is true: its study finished 8 trials, the committed winner is
    the study's best trial, and the config its rows name and every committed seed run of it use
    the winner's values."""
    import yaml
    from optuna.trial import TrialState

    name, best, study = _committed_study(best_path, tmp_path)
    finished = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.FAIL)]
    assert len(finished) == len(study.trials) == 8, name
    assert (study.best_trial.number, study.best_trial.value) == (best["trial"], pytest.approx(best["value"]))
    assert best["val_fraction"] == 0.1 and best["objective"] == "val_accuracy+val_accuracy_worst"

    config_path, runs_dir = WINNER_ROWS[name]
    runs = sorted((REPO / "docs" / "complete_runs" / runs_dir).glob("seed*/config.yaml"))
    assert len(runs) >= 3, f"{name}: the winner's rows need 3 seeds, found {len(runs)}"
    for config in [yaml.safe_load((REPO / config_path).read_text())] + [yaml.safe_load(p.read_text()) for p in runs]:
        assert config["data"]["init_args"]["val_fraction"] == best["val_fraction"]
        for key, value in study.best_trial.params.items():
            assert _today_value(config, key) == (value if value is None else pytest.approx(value, rel=1e-12)), (name, key)


def test_the_index_of_complete_runs_is_what_the_script_writes_from_the_committed_runs(tmp_path):
    """docs/complete_runs/index.csv lists every committed run, each row true to its run directory."""
    import csv

    folder = REPO / "docs" / "complete_runs"
    index = complete_runs_index()
    fresh = tmp_path / "index.csv"
    index.write(fresh)
    assert fresh.read_text() == (folder / "index.csv").read_text()  # regenerate: python docs/complete_runs/index.py write
    rows = list(csv.DictReader((folder / "index.csv").open()))
    assert {row["table"] for row in rows} >= {"fedfdp-IV", "fedfdp-V", "fedfdp-VI"}
    for row in rows:
        summary = json.loads((folder / row["path"] / "summary.json").read_text())
        assert row["status"] == summary.get("status", row["status"]) and int(row["rounds"]) == summary["rounds_run"]
        assert row["dataset"] in ("fmnist", "mnist") and row["seed"] in ("0", "1", "2")
        if row["table"].startswith("fedfdp-"):  # the paper tables: complete, every release accounted
            assert row["status"] in ("completed", "budget_spent")
            # the one non-private row a paper table carries is each client alone without DP, told by what
            # the run trained (its algorithm), not by its folder's name: every other row must be dp_valid
            config = yaml.safe_load((folder / row["path"] / "config.yaml").read_text())
            no_dp = config["model"]["algorithm"]["class_path"] == "fedfdp.algorithms.LocalOnly"
            assert (row["dp_valid"], row["epsilon"]) == ("False", "") if no_dp else row["dp_valid"] == "True", row


def _data_classes() -> list[str]:
    classes = set()
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        data = (yaml.safe_load(path.read_text()) or {}).get("data")
        if isinstance(data, dict) and "class_path" in data:
            classes.add(data["class_path"].rsplit(".", 1)[-1])
    return sorted(classes)


@pytest.mark.parametrize("data_class", _data_classes())
def test_every_shipped_data_class_has_an_index_dataset(data_class):
    """The index names a run's dataset from its config's data class, RC-DPFL's clustered ones too
    (``ClusteredMNISTDataModule`` is ``mnist``, as the issue's ``dataset`` column asks): every data
    class a shipped config uses, generated from configs/, gets a short name, the MNIST family
    ``mnist`` or ``fmnist``."""
    name = complete_runs_index().dataset_name(data_class)
    assert name.islower() and "datamodule" not in name, (data_class, name)
    if "MNIST" in data_class and "FEMNIST" not in data_class:  # LEAF's FEMNIST is a dataset of its own
        assert name == ("fmnist" if "Fashion" in data_class else "mnist"), (data_class, name)


def test_the_budget_curve_is_the_running_best_of_a_studys_finished_trials(tmp_path, capsys):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study_dir = tmp_path / "study"
    study_dir.mkdir()
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{study_dir / 'study.db'}", direction="maximize")
    for value in (0.5, 0.4, 0.9, None, 0.7):  # None: a failed trial, not counted
        trial = study.ask()
        study.tell(trial, value, state=optuna.trial.TrialState.FAIL if value is None else None)
    script = runpy.run_path(str(REPO / "docs" / "complete_runs" / "budget_curve.py"))
    assert script["running_best"](study_dir) == [0.5, 0.5, 0.9, 0.9]
    out = tmp_path / "curve.png"
    assert script["main"](["--out", str(out), f"demo={study_dir}"]) == 0
    assert out.stat().st_size > 0
    assert "demo: 4 trials, best 0.9000 (first reached at finished trial 3" in capsys.readouterr().out


RANKED = sorted((REPO / "docs" / "complete_runs" / "tuning" / "ranked").glob("*/best.json"))
#: Scored trials a ranked study holds before its winner may be run on test (issue 39: 64); the
#: no-DP reference is a grid, finished when every point has run.
RANKED_TRIALS = {"local_scatter": 8}


def _close(actual, expected) -> bool:
    """``actual`` has ``expected``'s values (a run's config also spells out the defaults)."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(k in actual and _close(actual[k], v) for k, v in expected.items())
    if isinstance(expected, float):
        return actual == pytest.approx(expected, rel=1e-12)
    return actual == expected


@pytest.mark.parametrize("best_path", RANKED, ids=lambda p: p.parent.name)
def test_a_ranked_winner_is_its_studys_best_trial_and_only_a_finished_study_has_test_runs(best_path, tmp_path):
    """best.json is the study's best trial; test runs of a study's winner exist only once the study
    holds its budget of scored trials (the test splits are read after the search, never during it),
    and every such run trains the winner's values."""
    import yaml
    from optuna.trial import TrialState

    name, best, study = _committed_study(best_path, tmp_path)
    assert (study.best_trial.number, study.best_trial.value) == (best["trial"], pytest.approx(best["value"]))
    assert best["val_fraction"] == 0.1 and best["objective"] == "val_accuracy+val_accuracy_worst"
    scored = sum(t.state == TrialState.COMPLETE for t in study.trials)
    runs = sorted((REPO / "docs" / "complete_runs").glob(f"ranked_*/{name}_*/seed*/config.yaml"))
    if runs:
        assert scored >= RANKED_TRIALS.get(name, 64), f"{name}: test runs of a winner after {scored} scored trials"
    for path in runs:
        config = yaml.safe_load(path.read_text())
        assert config["data"]["init_args"]["val_fraction"] == best["val_fraction"]
        for key, value in best["overrides"].items():
            assert _close(_dotted(config, key), value), (path, key)


@pytest.mark.parametrize("config_path", sorted((REPO / "configs" / "tuned").glob("*_64trials.yaml")), ids=lambda p: p.stem)
def test_a_shipped_64_trial_config_is_its_studys_winner(config_path):
    """configs/tuned/fmnist_<study>_64trials.yaml is the committed best.yaml of that ranked study (which
    keeps the spelling before ``privacy=``, read in today's: :mod:`fedfdp.algorithms.retired`)."""
    import yaml

    from fedfdp.algorithms.retired import upgrade_config

    study = config_path.stem.removeprefix("fmnist_").removesuffix("_64trials")
    best = REPO / "docs" / "complete_runs" / "tuning" / "ranked" / study / "best.yaml"
    assert yaml.safe_load(config_path.read_text()) == upgrade_config(yaml.safe_load(best.read_text()))


RCDPFL_LR = sorted((REPO / "docs" / "complete_runs" / "tuning" / "rcdpfl_lr").glob("*/best.json"))
RCDPFL_LR_SETTINGS = {"mnist": "MNIST, ε = 5", "digits": "digits, ε = 2"}
RCDPFL_LR_LABELS = {"local": "each client alone, DP-SGD", "rcdpfl": "RC-DPFL", "dpfedavg": "DPFedAvg",
                    "kmcdpfl": "KM-CDPFL", "ifca": "IFCA, private selection"}


def _results_row(prefix: str) -> list[str]:
    row = next(line for line in RESULTS.read_text().splitlines() if line.replace("**", "").startswith(prefix))
    return [cell.strip().replace("**", "") for cell in row.strip().strip("|").split("|")]


@pytest.mark.parametrize("best_path", RCDPFL_LR, ids=lambda p: p.parent.name)
def test_the_rcdpfl_lr_grid_ran_every_point_and_results_show_what_it_found(best_path, tmp_path):
    """docs/results/rcdpfl.md's "both tuned on one plain lr grid": each committed study ran every lr of the
    grid once, its chosen lr is its best trial, the validation row shows the study's values, and
    the test row is the chosen lr's rcdpfl-table output (test_at_chosen_lr.md)."""
    from optuna.trial import TrialState

    name, best, study = _committed_study(best_path, tmp_path)
    key = "model.algorithm.init_args.lr"
    grid = yaml.safe_load((best_path.parent.parent / "lr_grid.yaml").read_text())[key]["choices"]
    complete = {t.params[key]: t.value for t in study.trials if t.state == TrialState.COMPLETE}
    assert sorted(complete) == sorted(grid) and len(study.trials) == len(grid), name
    assert (study.best_trial.number, study.best_trial.value) == (best["trial"], pytest.approx(best["value"]))
    assert best["val_fraction"] == 0.1 and best["objective"] == "val_accuracy" and best["last"] == 1

    dataset, method = name.split("_", 1)
    setting, label = RCDPFL_LR_SETTINGS[dataset], RCDPFL_LR_LABELS[method]
    validation = _results_row(f"| {setting} | {label} |")
    assert [float(cell) for cell in validation[2:2 + len(grid)]] == [
        pytest.approx(100 * complete[lr], abs=0.051) for lr in grid], name
    assert validation[2 + len(grid)].split()[0] == f"{best['params'][key]:g}", name

    tested = (best_path.parent / "test_at_chosen_lr.md").read_text().splitlines()
    tested_row = [c.strip() for c in next(line for line in tested if line.startswith("| ")
                                          and not line.startswith("| ε")).strip().strip("|").split("|")]
    shown = _results_row(f"| {setting} | {label} ({best['params'][key]:g}) |")
    assert shown[2:6] == tested_row[2:6], name  # All, Maj, Min, MinAcc


POPULATION_STUDIES = sorted((REPO / "docs" / "complete_runs" / "tuning" / "population").glob("*/best.json"))
#: Each population study: the config its rows name and the prefix of its committed rows' folders
#: (``<prefix>*``: one folder per client-level epsilon; the non-private row has one).
POPULATION_ROWS = {
    "client_dp": ("configs/tuned/population_client_dp.yaml", "client_dp_fixed_eps"),
    "client_dp_adaptive": ("configs/tuned/population_client_dp_adaptive.yaml", "client_dp_adaptive_eps"),
    "fedavg": ("configs/tuned/population_fedavg.yaml", "fedavg_nonprivate"),
}


@pytest.mark.parametrize("best_path", POPULATION_STUDIES, ids=lambda p: p.parent.name)
def test_a_population_row_runs_its_studys_winner(best_path, tmp_path):
    """The population table's rows are what their 8-trial studies chose on validation data: the study
    finished 8 trials, best.json is its best trial, and the row's config and every committed run of it
    (any epsilon, 3 seeds at least where committed) use the winner's values and the same held-out split."""
    import shutil

    import optuna
    import yaml
    from optuna.trial import TrialState

    best = json.loads(best_path.read_text())
    db = tmp_path / "study.db"
    shutil.copy(best_path.parent / "study.db", db)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=best["study"], storage=f"sqlite:///{db}")
    finished = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.FAIL)]
    assert len(finished) == len(study.trials) == 8
    assert (study.best_trial.number, study.best_trial.value) == (best["trial"], pytest.approx(best["value"]))
    config_path, prefix = POPULATION_ROWS[best_path.parent.name]
    runs = sorted((REPO / "docs" / "complete_runs" / "population_fmnist").glob(f"{prefix}*/seed*/config.yaml"))
    for folder in {p.parent.parent for p in runs}:
        assert len(list(folder.glob("seed*/config.yaml"))) >= 3, f"{folder.name}: a row needs 3 seeds"
    for config in [yaml.safe_load((REPO / config_path).read_text())] + [yaml.safe_load(p.read_text()) for p in runs]:
        assert config["data"]["init_args"]["val_fraction"] == best["val_fraction"]
        for key, value in study.best_trial.params.items():
            assert _dotted(config, key) == pytest.approx(value, rel=1e-12), key
