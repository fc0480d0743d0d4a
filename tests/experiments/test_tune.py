"""The tuning command (``python -m fedfdp.experiments tune``) and the validation split it scores on."""

from __future__ import annotations

import json
import re

import numpy as np
import optuna
import pytest
import torch
import yaml

from fedfdp.algorithms import FedAvg
from fedfdp.experiments.__main__ import main
from fedfdp.experiments.search_space import baseline_params, load_space
from fedfdp.experiments.trials import objective_value, parse_objective
from fedfdp.fit import main as fit_main
from tests.conftest import REPO
from tests.helpers import flat, run_federation, tiny_data

TINY = REPO / "tests" / "configs" / "tiny_fedfdp.yaml"
#: The fingerprint of tests/configs/tiny_fedfdp.yaml's partition before val_fraction existed.
TINY_FINGERPRINT = "846520f482d61ce38ac221a73223c2679233ee44785bc7e4d223385bd0ed346a"


def _tiny(**kwargs):
    dm = tiny_data(num_samples=400, **kwargs)
    dm.setup()
    return dm


# ---- the validation split ---------------------------------------------------------------------------
def test_val_split_is_held_out_of_each_clients_training_split():
    plain, held = _tiny(), _tiny(val_fraction=0.1)
    assert held.has_validation and not plain.has_validation
    for cid, ((tr0, te0), (tr, te), va) in enumerate(zip(plain._indices, held._indices, held._val_indices)):
        assert np.array_equal(te, te0)  # the test split does not move
        assert set(va) <= set(tr0) and not set(va) & set(tr) and not set(va) & set(te)
        assert sorted({*tr, *va}) == sorted(tr0)  # train + val = the original training split
        assert len(va) == round(0.1 * len(tr0))
        x_val, y_val = held.client_val(cid)
        assert len(y_val) == len(va) == held.val_sizes[cid] and len(held.client_train(cid)[1]) == len(tr)
    x, y, cid, _ = held.pooled_raw("val")
    assert len(y) == held.val_sizes.sum() and torch.equal(torch.bincount(cid), torch.as_tensor(held.val_sizes))
    # seeded by the partition seed: the same again, another with another seed
    again, other = _tiny(val_fraction=0.1), _tiny(val_fraction=0.1, partition_seed=2)
    assert all(np.array_equal(a, b) for a, b in zip(held._val_indices, again._val_indices))
    assert held.fingerprint() == again.fingerprint() != other.fingerprint()
    assert held.partition_config()["val_fraction"] == 0.1 and held.fingerprint() != plain.fingerprint()
    assert held.state_dict()["val_sizes"] == held.val_sizes.tolist()
    with pytest.raises(RuntimeError, match="val_fraction"):
        plain.client_val(0)


def test_val_fraction_zero_leaves_the_partition_and_first_round_model_unchanged():
    default, zero = _tiny(), _tiny(val_fraction=0.0)
    assert default.fingerprint() == zero.fingerprint() == TINY_FINGERPRINT
    assert "val_fraction" not in zero.partition_config() and "val_sizes" not in zero.state_dict()
    models = {}
    for name, kwargs in (("default", {}), ("zero", {"val_fraction": 0.0}), ("held", {"val_fraction": 0.1})):
        fed, _ = run_federation(FedAvg(lr=0.1, batch_size=16), [], rounds=1, data=tiny_data(num_samples=400, **kwargs))
        models[name] = (flat(fed.global_model), fed.last_evaluation.scalars)
    assert torch.equal(models["default"][0], models["zero"][0])
    assert models["default"][1] == models["zero"][1] and "val_accuracy" not in models["zero"][1]
    assert not torch.equal(models["default"][0], models["held"][0])  # it trains on fewer samples
    scalars = models["held"][1]
    assert {"val_accuracy", "val_accuracy_worst", "val_psi", "val_accuracy_jain"} <= set(scalars)


def test_bad_val_fraction_is_a_config_error():
    from fedfdp.errors import ConfigError

    with pytest.raises(ConfigError, match=r"data.val_fraction must be in \[0, 1\)"):
        tiny_data(val_fraction=1.0)


# ---- the objective ------------------------------------------------------------------------------------
def test_objective_reads_validation_metrics_of_the_last_evaluations_only():
    assert parse_objective("val_accuracy+0.5*val_accuracy_worst") == [(1.0, "val_accuracy"),
                                                                       (0.5, "val_accuracy_worst")]
    assert parse_objective("val_accuracy - 10*val_psi") == [(1.0, "val_accuracy"), (-10.0, "val_psi")]
    history = [{"round": r, "val_accuracy": 0.1 * r, "val_accuracy_worst": 0.05 * r, "accuracy": 0.9}
               for r in range(1, 8)]
    summary = {"history": history, "final": {"accuracy": 0.99}, "best_accuracy": 0.99}
    terms = parse_objective("val_accuracy+val_accuracy_worst")
    assert objective_value(summary, terms, 5) == pytest.approx(np.mean([0.15 * r for r in range(3, 8)]))
    for row in history:  # changing every test metric changes nothing
        row["accuracy"] = 0.0
    summary["final"]["accuracy"] = summary["best_accuracy"] = 0.0
    assert objective_value(summary, terms, 5) == pytest.approx(np.mean([0.15 * r for r in range(3, 8)]))
    with pytest.raises(ValueError, match="val_fraction"):
        objective_value({"history": [{"accuracy": 1.0}]}, terms, 5)


# ---- the command ---------------------------------------------------------------------------------------
def _tune(study_dir, *extra):
    return main(["tune", "--config", str(TINY), "--study-dir", str(study_dir), "--rounds", "2", *extra])


def test_dry_run_writes_nothing(tmp_path, capsys):
    study_dir = tmp_path / "study"
    assert _tune(study_dir, "--trials", "2", "--dry-run") == 0
    assert not study_dir.exists()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 2
    for k, line in enumerate(lines):
        assert f"--run_dir {study_dir / f'trial{k}'} " in line and "--data.init_args.val_fraction 0.1" in line
        assert "--model.num_rounds 2" in line and "--wandb_group study" in line


@pytest.mark.parametrize("args, message", [
    (["--trials", "0"], "--trials must be >= 1"),
    (["--trials", "2", "--jobs", "0"], "--jobs must be >= 1"),
    (["--trials", "2", "--objective", "accuracy"], "validation metrics only"),
    (["--trials", "2", "--objective", "val_accuracy*"], "--objective must be a sum"),
    (["--trials", "2", "--val-fraction", "0"], "--val-fraction must be in (0, 1)"),
    (["--trials", "2", "--rounds", "0"], "--rounds must be >= 1"),
    (["--trials", "2", "--space", "missing.yaml"], "--space missing.yaml cannot be read"),
    (["--trials", "x"], "invalid int value"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, args, message):
    try:
        code = _tune(tmp_path / "study", *args)
    except SystemExit as exit_info:  # argparse's own errors
        code = exit_info.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "study").exists()


def test_bad_search_space_is_a_one_line_error(tmp_path, capsys):
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"model.algorithm.init_args.lr": {"type": "float", "low": 1.0, "high": 0.1}}))
    assert _tune(tmp_path / "study", "--trials", "1", "--space", str(space)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: tune: search space: model.algorithm.init_args.lr") and len(err.splitlines()) == 1


GRID = {"model.algorithm.init_args.lr": {"type": "categorical", "choices": [0.5, 1.0, 2.0]},
        "model.server_optimizer": {"type": "categorical", "choices": {
            "plain": {"class_path": "torch.optim.SGD", "init_args": {"lr": 1.0}},
            "momentum": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5, "momentum": 0.5}}}}}


def test_grid_sampler_visits_every_point_once_and_stops_at_the_grid(tmp_path, capsys):
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(GRID))
    assert _tune(tmp_path / "study", "--trials", "50", "--sampler", "grid", "--space", str(space), "--dry-run") == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    points = {(line.split("--model.algorithm.init_args.lr ")[1].split()[0], "momentum" in line) for line in lines}
    assert len(lines) == 6 and points == {(lr, m) for lr in ("0.5", "1.0", "2.0") for m in (False, True)}
    assert not any("--model.server_optimizer.momentum 0.5" in line and "--model.server_optimizer.lr 1.0" in line
                   for line in lines)


@pytest.mark.slow
def test_a_grid_study_runs_each_point_once_and_writes_the_best_config(tmp_path, capsys):
    """Optuna's GridSampler stops a study from inside ``Study.optimize`` only; the ask-and-tell loop
    must end after the last point by itself and still write best.yaml (it raised there once)."""
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"model.algorithm.init_args.lr": {"type": "categorical", "choices": [0.5, 1.0]}}))
    study_dir = tmp_path / "study"
    assert _tune(study_dir, "--trials", "5", "--sampler", "grid", "--space", str(space)) == 0
    study = optuna.load_study(study_name="study", storage=f"sqlite:///{study_dir / 'study.db'}")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]
    assert sorted(t.params["model.algorithm.init_args.lr"] for t in study.trials) == [0.5, 1.0]
    best = yaml.safe_load((study_dir / "best.yaml").read_text())
    assert best["model"]["algorithm"]["init_args"]["lr"] == study.best_trial.params["model.algorithm.init_args.lr"]
    assert "2 finished trials" in capsys.readouterr().out


def test_grid_sampler_refuses_a_continuous_distribution_naming_it(tmp_path, capsys):
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({**GRID, "model.ema_decay": {"type": "float", "low": 0.5, "high": 0.9}}))
    assert _tune(tmp_path / "study", "--trials", "2", "--sampler", "grid", "--space", str(space)) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: tune: search space: model.ema_decay: --sampler grid needs categorical choices, got type float"
    assert not (tmp_path / "study").exists()


class FakeTrials:
    """Stands in for ``run_trial`` (a fedfdp.fit subprocess): records how many trials overlap and
    scores a trial by its values, failing the ones listed in ``fail``.

    The first ``jobs`` trials wait (up to 20 s) until ``jobs`` of them run at once, so a harness that
    runs them concurrently shows it however slow the machine, and one that runs them one by one
    keeps ``peak`` at 1."""

    def __init__(self, fail=(), jobs=1):
        import threading

        self.lock, self.active, self.peak, self.fail = threading.Lock(), 0, 0, set(fail)
        self.jobs, self.all_running = jobs, threading.Event()

    def __call__(self, settings, number, overrides):
        import time

        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
            if self.active >= self.jobs:
                self.all_running.set()
        if number < self.jobs:
            self.all_running.wait(timeout=20)
        time.sleep(0.01 * (number % 3))  # trials end out of order
        with self.lock:
            self.active -= 1
        if number in self.fail:
            return None, {"error": f"trial {number} diverged"}
        return float(overrides["model.algorithm.init_args.lr"]), {"run_dirs": [str(settings.run_dir(number, 0))]}


@pytest.mark.slow
@pytest.mark.parametrize("jobs", [2, 3])
def test_parallel_trials_draw_the_sequential_studys_values_and_keep_every_result(tmp_path, monkeypatch, jobs):
    from fedfdp.experiments import tune

    def study_of(name, jobs, fake):
        monkeypatch.setattr(tune, "run_trial", fake)
        assert _tune(tmp_path / name, "--trials", "7", "--jobs", str(jobs)) == 0
        return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / name / 'study.db'}")

    sequential, fake = study_of("sequential", 1, FakeTrials(fail={4})), FakeTrials(fail={4}, jobs=jobs)
    parallel = study_of("parallel", jobs, fake)
    assert fake.peak == jobs  # trials overlapped, never more than --jobs of them
    assert [t.params for t in parallel.trials] == [t.params for t in sequential.trials]  # same draws, same order
    assert [t.state.name for t in parallel.trials] == ["COMPLETE"] * 4 + ["FAIL"] + ["COMPLETE"] * 2
    assert all(t.value == t.params["model.algorithm.init_args.lr"] for t in parallel.trials if t.value is not None)
    best = json.loads((tmp_path / "parallel" / "best.json").read_text())
    assert best["trial"] == parallel.best_trial.number and best["trials_finished"] == 6


@pytest.mark.slow
def test_parallel_study_stops_when_its_first_trials_all_fail(tmp_path, monkeypatch, capsys):
    from fedfdp.experiments import tune

    monkeypatch.setattr(tune, "run_trial", FakeTrials(fail=set(range(10)), jobs=3))
    assert _tune(tmp_path / "study", "--trials", "6", "--jobs", "3") == 2
    assert "failed and the study has no finished trial" in capsys.readouterr().err
    study = optuna.load_study(study_name="study", storage=f"sqlite:///{tmp_path / 'study' / 'study.db'}")
    assert len(study.trials) == 3  # no trial was started after the first failure


def _history_mean(run_dir, key="val_accuracy", last=5):
    history = json.loads((run_dir / "summary.json").read_text())["history"]
    return float(np.mean([h[key] for h in history[-last:]]))


@pytest.mark.slow
def test_study_scores_on_validation_resumes_and_writes_a_loadable_best_config(tmp_path, capsys):
    study_dir = tmp_path / "study"
    storage = f"sqlite:///{study_dir / 'study.db'}"
    assert _tune(study_dir, "--trials", "1") == 0
    study = optuna.load_study(study_name="study", storage=storage)
    (first,) = study.trials
    assert first.state.name == "COMPLETE"
    trial0 = study_dir / "trial0"
    assert first.value == pytest.approx(_history_mean(trial0))  # the validation metric of the run
    summary = json.loads((trial0 / "summary.json").read_text())
    assert summary["rounds_run"] == 2 and all("val_accuracy" in h for h in summary["history"])
    config = yaml.safe_load((trial0 / "config.yaml").read_text())
    assert config["data"]["init_args"]["val_fraction"] == 0.1
    assert config["model"]["algorithm"]["init_args"]["lr"] == 1.0  # trial 0: the config's own values
    trial0_log = (trial0 / "fit.log").read_text()

    # an interrupted trial 1: asked, its run stopped after round 1 of 2 (a checkpoint, no result)
    study = optuna.load_study(study_name="study", storage=storage)
    trial = study.ask()
    overrides = {"model.algorithm.init_args.lr": 0.5, "model.algorithm.init_args.privacy.init_args.local_steps": 1}
    trial.set_user_attr("overrides", overrides)
    from fedfdp.experiments.__main__ import build_parser
    from fedfdp.experiments.tune import _settings as settings_of
    from fedfdp.experiments.trials import fit_command

    settings = settings_of(build_parser().parse_args(
        ["tune", "--config", str(TINY), "--study-dir", str(study_dir), "--rounds", "2", "--trials", "2"]))
    trial1 = study_dir / "trial1"
    trial1.mkdir()
    partial = fit_command(settings, trial1, 0, overrides)[3:]
    partial[partial.index("--model.num_rounds") + 1] = "1"
    assert fit_main(partial + ["--wandb", "disabled"]) == 0
    assert (trial1 / "checkpoints" / "last.ckpt").exists()
    summary1 = json.loads((trial1 / "summary.json").read_text())
    summary1["rounds_planned"] = 2  # as a run of 2 rounds stopped after its first one would have left it
    (trial1 / "summary.json").write_text(json.dumps(summary1))

    capsys.readouterr()
    assert _tune(study_dir, "--trials", "2") == 0
    out = capsys.readouterr().out
    study = optuna.load_study(study_name="study", storage=storage)
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]  # 2 trials, no third
    assert (trial0 / "fit.log").read_text() == trial0_log  # trial 0 was not run again
    harness = json.loads((trial1 / "harness.json").read_text())
    assert "--ckpt_path" in harness["command"]  # trial 1 resumed from its checkpoint
    assert json.loads((trial1 / "summary.json").read_text())["rounds_run"] == 2
    assert study.trials[1].value == pytest.approx(_history_mean(trial1))
    assert "shortened study" in out and "not charged to the privacy budget" in out

    # best.yaml: the config with the best values and the same validation split; it loads
    best = study.best_trial
    best_yaml = study_dir / "best.yaml"
    info = json.loads((study_dir / "best.json").read_text())
    assert info["trial"] == best.number and info["value"] == pytest.approx(best.value)
    assert f"--config {best_yaml}" in out
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        fit_main(["--config", str(best_yaml), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["init_args"]["val_fraction"] == 0.1
    assert printed["model"]["algorithm"]["init_args"]["lr"] == pytest.approx(
        best.user_attrs["overrides"]["model.algorithm.init_args.lr"])

    # the study is tied to its settings
    assert _tune(study_dir, "--trials", "3", "--objective", "val_accuracy_worst") == 2
    assert "other settings: objective" in capsys.readouterr().err


SEARCH_SPACES = sorted((REPO / "configs" / "search_spaces").glob("*.yaml"))


@pytest.mark.parametrize("path", SEARCH_SPACES, ids=[p.stem for p in SEARCH_SPACES])
def test_shipped_search_spaces_load_and_start_from_their_base_config(path):
    """Each equal-budget space (issue 23 item 6) is valid, names its base config, and contains that
    config's own values, so trial 0 is the shipped config (the same start for every method)."""
    base = re.search(r"^# base config: (\S+)$", path.read_text(), re.M)
    assert base, f"{path.name} names no '# base config:'"
    config = yaml.safe_load((REPO / base.group(1)).read_text())
    space = load_space(str(path))
    assert set(baseline_params(config, space)) == set(space), "the base config's values lie outside the space"
    assert "8 Optuna trials" in path.read_text()  # the same budget for every method


@pytest.mark.slow
def test_a_study_continues_from_another_checkout_but_not_with_another_config(tmp_path, capsys):
    """The study is tied to the config's content, not its path: study.db copied beside a copy of the
    checkout continues (issue 23 item 6 runs across sessions); a config whose content differs is refused."""
    first = tmp_path / "first" / "tiny.yaml"
    first.parent.mkdir()
    first.write_text(TINY.read_text())
    study_dir = tmp_path / "study"
    assert main(["tune", "--config", str(first), "--study-dir", str(study_dir), "--rounds", "1", "--trials", "1"]) == 0
    moved = tmp_path / "second" / "study"
    moved.mkdir(parents=True)
    (moved / "study.db").write_bytes((study_dir / "study.db").read_bytes())
    copy = tmp_path / "second" / "tiny.yaml"
    copy.write_text(TINY.read_text())
    capsys.readouterr()
    assert main(["tune", "--config", str(copy), "--study-dir", str(moved), "--rounds", "1", "--trials", "1"]) == 0
    assert "study study: 1 finished trials, 0 failed" in capsys.readouterr().out
    assert not (moved / "trial0").exists()  # nothing re-run
    copy.write_text(TINY.read_text() + "\n# another config\n")
    assert main(["tune", "--config", str(copy), "--study-dir", str(moved), "--rounds", "1", "--trials", "2"]) == 2
    err = capsys.readouterr().err
    assert "is not the one the study" in err and str(first) in err


@pytest.mark.slow
def test_batched_trials_draw_the_sequential_studys_values_in_batches_of_r(tmp_path, monkeypatch):
    from fedfdp.experiments import tune

    batches = []

    def together(settings, trials):
        batches.append([number for number, _ in trials])
        fake = FakeTrials(fail={4})
        return [fake(settings, number, overrides) for number, overrides in trials]

    monkeypatch.setattr(tune, "run_trial", FakeTrials(fail={4}))
    assert _tune(tmp_path / "sequential", "--trials", "7") == 0
    monkeypatch.setattr(tune, "run_trials_together", together)
    assert _tune(tmp_path / "batched", "--trials", "7", "--batch", "3") == 0
    assert batches == [[0, 1, 2], [3, 4, 5], [6]]
    load = lambda name: optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / name / 'study.db'}")  # noqa: E731
    sequential, batched = load("sequential"), load("batched")
    assert [t.params for t in batched.trials] == [t.params for t in sequential.trials]
    assert [t.state.name for t in batched.trials] == ["COMPLETE"] * 4 + ["FAIL"] + ["COMPLETE"] * 2


def test_batch_and_startup_options_are_checked(tmp_path, capsys):
    assert _tune(tmp_path / "s", "--trials", "2", "--batch", "2", "--jobs", "2") == 2
    assert "--batch > 1 runs its trials in this process" in capsys.readouterr().err
    assert _tune(tmp_path / "s", "--trials", "2", "--startup-trials", "-1") == 2
    assert "--startup-trials must be >= 0" in capsys.readouterr().err


@pytest.mark.slow
def test_a_batch_of_real_trials_fits_together_and_scores_each_on_validation(tmp_path):
    study_dir = tmp_path / "study"
    space = tmp_path / "space.yaml"  # one-step DP-SGD trials: what the sweep engine batches
    space.write_text(yaml.safe_dump({"model.algorithm.init_args.lr": {"type": "float", "low": 0.2, "high": 2.0}}))
    assert _tune(study_dir, "--trials", "2", "--batch", "2", "--rounds", "2", "--space", str(space)) == 0
    study = optuna.load_study(study_name="study", storage=f"sqlite:///{study_dir / 'study.db'}")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]
    for trial in study.trials:
        run_dir = study_dir / f"trial{trial.number}"
        assert json.loads((run_dir / "harness.json").read_text())["command"][0] == "sweep"
        assert trial.value == pytest.approx(_history_mean(run_dir))


def test_trials_txt_has_one_line_per_ended_trial_matching_the_study(tmp_path, monkeypatch):
    """``trials.txt`` is rewritten after every trial: trial order, state, objective, each term alone,
    rounds, ε and the sampled values; a failed trial says why (its line has no value)."""
    from fedfdp.experiments import tune

    def fake(settings, number, overrides):
        if number == 2:
            return None, {"error": "trial 2 diverged", "rounds_run": [3]}
        lr = float(overrides["model.algorithm.init_args.lr"])
        return lr, {"val_accuracy": [lr / 2, lr / 4], "rounds_run": [7, 7], "epsilon": [1.25, 1.5]}

    monkeypatch.setattr(tune, "run_trial", fake)
    assert _tune(tmp_path / "study", "--trials", "4") == 0
    study = optuna.load_study(study_name="study", storage=f"sqlite:///{tmp_path / 'study' / 'study.db'}")
    lines = (tmp_path / "study" / "trials.txt").read_text().splitlines()
    assert lines[0].startswith("# study study: objective val_accuracy")
    assert len(lines) == 1 + len(study.trials) == 5
    for line, trial in zip(lines[1:], study.trials):
        assert line.startswith(f"trial{trial.number} {trial.state.name}")
        lr = trial.params["model.algorithm.init_args.lr"]
        assert f"lr={lr:.4g}" in line
        if trial.number == 2:
            assert "value" not in line and "error trial 2 diverged" in line and "rounds 3" in line
        else:
            assert f"value {trial.value:.4f}" in line
            assert f"val_accuracy {100 * (lr / 2 + lr / 4) / 2:.2f}" in line and "rounds 7/7 eps 1.500" in line


RANKED_SPACES = sorted((REPO / "configs" / "search_spaces" / "ranked").glob("*.yaml"))


@pytest.mark.parametrize("path", RANKED_SPACES, ids=[p.stem for p in RANKED_SPACES])
def test_ranked_search_spaces_load_and_contain_their_base_config(path):
    """The ranked studies' spaces (docs/complete_runs/tuning/ranked/) are valid, name their base
    config and contain every value it sets, so a TPE study's trial 0 (and a grid's point) is that
    config; an option the config leaves unset (no server optimizer: the plain average) is drawn."""
    base = re.search(r"^# base config: (\S+)", path.read_text(), re.M)
    assert base, f"{path.name} names no '# base config:'"
    config = yaml.safe_load((REPO / base.group(1)).read_text())
    space = load_space(str(path))

    def set_in(config: dict, key: str) -> bool:
        node = config
        for part in key.split("."):
            if not isinstance(node, dict) or node.get(part) is None:
                return False
            node = node[part]
        return True

    expected = {key for key in space if set_in(config, key)}
    assert expected and expected <= set(baseline_params(config, space)), "the base config's values lie outside the space"


def test_baseline_params_reproduce_a_named_alternative_with_its_inner_values():
    """Trial 0 of a space with named alternatives (the server optimizer) is the config's own node:
    the alternative whose fixed parts match, and the values of the distributions inside it."""
    from fedfdp.experiments.search_space import sample_overrides

    space = {"model.server_optimizer": {"type": "categorical", "choices": {
        "adam": {"class_path": "torch.optim.Adam", "init_args": {"lr": {"type": "float", "low": 1e-3, "high": 1.0}}},
        "sgd": {"class_path": "torch.optim.SGD",
                "init_args": {"lr": 1.0, "momentum": {"type": "float", "low": 0.0, "high": 0.9}}}}},
        "model.ema_decay": {"type": "categorical", "choices": [None, 0.9]}}
    node = {"class_path": "torch.optim.SGD", "init_args": {"lr": 1.0, "momentum": 0.5}}
    config = {"model": {"server_optimizer": node, "ema_decay": 0.9}}
    params = baseline_params(config, space)
    assert params == {"model.server_optimizer": "sgd", "model.server_optimizer.sgd.init_args.momentum": 0.5,
                      "model.ema_decay": 0.9}
    study = optuna.create_study()
    study.enqueue_trial(params)
    assert sample_overrides(study.ask(), space) == {"model.server_optimizer": node, "model.ema_decay": 0.9}
    for other in ({"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5, "momentum": 0.5}},  # a fixed part differs
                  {"class_path": "torch.optim.SGD", "init_args": {"lr": 1.0, "momentum": 0.95}},  # out of range
                  {"class_path": "torch.optim.SGD", "init_args": {"lr": 1.0, "momentum": 0.5, "nesterov": True}}):
        assert "model.server_optimizer" not in baseline_params({"model": {"server_optimizer": other}}, space)
