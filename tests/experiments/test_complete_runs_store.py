"""The committed runs' store (``docs/complete_runs/index.py``): ``add`` a harness tree's finished
runs, ``restore`` them to a checkout without ``runs/``, ``park`` the unfinished ones across sessions."""

from __future__ import annotations

import gzip
import json

from tests.helpers import complete_runs_index


def test_add_commits_the_finished_runs_of_every_harness_tree(tmp_path):
    """``index.py add`` reads the trees of the paper tables, finp-table and rcdpfl-table: each
    finished run lands in ``<dest>/<name>/seed<k>`` with its files (logs gzipped); unfinished runs
    and runs moved aside are left out."""
    index = complete_runs_index()

    def run(path, status="budget_spent"):
        path.mkdir(parents=True)
        (path / "summary.json").write_text(json.dumps({"status": status}))
        (path / "config.yaml").write_text("seed_everything: 0\n")
        (path / "metrics.csv").write_text("step,accuracy\n0,0.5\n")
        (path / "privacy_ledger.jsonl").write_text('{"round": 0}\n')
        (path / "sia.json").write_text("{}")
        (path / "checkpoints").mkdir()

    trees = {
        "paper": (["fmnisteps1/local_dp/seed0", "fmnisteps1/local_dp/seed1", "dir0p5/local/seed2"],
                  {("local_dp_fmnisteps1", "seed0"), ("local_dp_fmnisteps1", "seed1"), ("local_dir0p5", "seed2")}),
        "finp": (["dpfedavg/seed0", "dpfinp_ala_b0.1/seed2"], {("dpfedavg", "seed0"), ("dpfinp_ala_b0.1", "seed2")}),
        "rcdpfl": (["runs/mnist_paper_rcdpfl_eps5_s0", "runs/mnist_paper_rcdpfl_seed_eps5_s1",
                    "runs/digits_ifca_eps2.5_s2", "runs/mnist_paper_local_nodp_s1", "runs/mnist_paper_local_eps1_s1"],
                   {("rcdpfl_eps5", "seed0"), ("rcdpfl_seed_eps5", "seed1"), ("ifca_eps2.5", "seed2"),
                    ("local_nodp", "seed1"), ("local_eps1", "seed1")}),
    }
    for tree, (paths, expected) in trees.items():
        src, dest = tmp_path / tree, tmp_path / f"{tree}_dest"
        for path in paths:
            run(src / path)
        unfinished = src / paths[0].replace("seed0", "seed3").replace("_s0", "_s3")
        run(unfinished, status="interrupted")
        run(src / (paths[0] + ".stale-20261128"))
        said = index.add(src, dest)
        assert {(p.parent.parent.name, p.parent.name) for p in dest.glob("*/seed*/summary.json")} == expected, tree
        assert sum(line.startswith("left out") and "interrupted" in line for line in said) == 1
        for target in dest.glob("*/seed*"):
            assert sorted(f.name for f in target.iterdir()) == ["config.yaml", "metrics.csv.gz",
                                                                "privacy_ledger.jsonl.gz", "sia.json", "summary.json"]
            assert gzip.decompress((target / "metrics.csv.gz").read_bytes()).startswith(b"step,accuracy")


def test_restore_writes_every_committed_run_back_where_its_harness_skips_it(tmp_path):
    """``index.py restore`` is ``add`` backwards (a fresh checkout has no ``runs/``): each committed
    run goes back to the ``--run_dir`` its ``harness.json`` names (relative, or absolute from its
    ``runs/`` folder on), logs unzipped, byte for byte what ``add`` committed; a run directory that
    exists is kept as it is; a run committed without ``harness.json`` is not restored. Adding the
    restored tree again commits nothing twice, not even the runs committed under other names."""
    from fedfdp.experiments.results import is_finished

    index = complete_runs_index()
    src, committed, root = tmp_path / "work", tmp_path / "complete_runs", tmp_path / "checkout"
    launched = {"runs/paper/table4/mnist/fedfdp/seed0": ("table4_mnist", "fedfdp_paper", "seed0"),  # renamed
                "/elsewhere/main/runs/finp_cnn/finp_pca/seed1": ("finp_fmnist", "finp_pca", "seed1"),
                "runs/rcdpfl_paper/runs/mnist_paper_ifca_eps5_s2": ("rcdpfl_mnist", "ifca_eps5", "seed2")}
    summary = {"status": "budget_spent", "rounds_run": 3, "rounds_planned": 3}
    for run_dir, (top, name, seed) in launched.items():
        run = src / run_dir.lstrip("/")
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps(summary))
        (run / "config.yaml").write_text(f"seed_everything: {seed[-1]}\n")
        (run / "metrics.csv").write_text(f"step,accuracy\n0,0.{seed[-1]}\n")
        (run / "harness.json").write_text(json.dumps({"command": ["python", "--run_dir", run_dir]}))
        (committed / top / name / seed).mkdir(parents=True)
        for file in ("summary.json", "config.yaml", "harness.json"):
            (committed / top / name / seed / file).write_bytes((run / file).read_bytes())
        (committed / top / name / seed / "metrics.csv.gz").write_bytes(gzip.compress((run / "metrics.csv").read_bytes()))
    (committed / "issue23_fmnist10" / "fedfdp" / "seed0").mkdir(parents=True)  # a study without harness.json
    (committed / "issue23_fmnist10" / "fedfdp" / "seed0" / "summary.json").write_text(json.dumps(summary))
    (root / "runs" / "finp_cnn" / "finp_pca" / "seed1").mkdir(parents=True)  # there already: kept
    said = index.restore(root, committed)
    assert sorted(line.split()[0] for line in said) == ["kept", "restored", "restored"], said
    for run_dir in ("runs/paper/table4/mnist/fedfdp/seed0", "runs/rcdpfl_paper/runs/mnist_paper_ifca_eps5_s2"):
        restored = root / run_dir
        assert sorted(f.name for f in restored.iterdir()) == ["config.yaml", "harness.json", "metrics.csv", "summary.json"]
        assert (restored / "metrics.csv").read_bytes() == (src / run_dir / "metrics.csv").read_bytes()
        assert is_finished(json.loads((restored / "summary.json").read_text()))
    assert not list((root / "runs" / "finp_cnn" / "finp_pca" / "seed1").iterdir())
    assert not (root / "issue23_fmnist10").exists() and len(list(root.rglob("summary.json"))) == 2
    before = sorted(p.relative_to(committed) for p in committed.rglob("*"))
    said = index.add(root / "runs" / "paper" / "table4" / "mnist", committed / "table4_mnist")
    said += index.add(root / "runs" / "rcdpfl_paper", committed / "rcdpfl_mnist")
    assert sorted(p.relative_to(committed) for p in committed.rglob("*")) == before
    assert [line.split()[0] for line in said] == ["kept", "added"], said  # the renamed one kept, ifca_eps5 rewritten in place


def test_park_keeps_an_unfinished_run_for_the_next_checkout_and_add_drops_it_once_finished(tmp_path):
    """``park`` copies each unfinished harness run with a loadable ``last.ckpt`` under
    ``in_progress/<run dir>`` (logs gzipped, no lock, only the last checkpoint); a finished run, a
    run moved aside and a checkpoint cut while written are not parked. ``restore`` into a fresh
    checkout gives back the same files, resumable (``Runner`` adds ``--ckpt_path last``); ``add``
    of the run once finished removes its parked copy."""
    import torch

    from fedfdp.experiments.runner import resumable

    index = complete_runs_index()
    work, committed, fresh = tmp_path / "work", tmp_path / "complete_runs", tmp_path / "fresh"

    def run(rel, status="interrupted", checkpoint=True):
        path = work / rel
        (path / "checkpoints").mkdir(parents=True)
        (path / "summary.json").write_text(json.dumps({"status": status}))
        (path / "config.yaml").write_text("seed_everything: 1\n")
        (path / "metrics.csv").write_text("step,accuracy\n0,0.5\n")
        (path / "privacy_ledger.jsonl").write_text('{"round": 0}\n')
        (path / "run.lock").write_text("4242")
        (path / "report.md").write_text("![accuracy](plots/accuracy.png)\n")  # written when a run is stopped
        (path / "plots").mkdir()
        (path / "plots" / "accuracy.png").write_bytes(b"\x89PNG")
        if checkpoint:
            torch.save({"global_step": 7}, path / "checkpoints" / "last.ckpt")
            torch.save({"global_step": 7}, path / "checkpoints" / "round-6.ckpt")
        return path

    cut = run("runs/rcdpfl_paper/runs/mnist_paper_ifca_eps5_s1")
    run("runs/finp_cnn/finp_pca/seed2", status="completed")
    run("runs/finp_cnn/finp_pca/seed1.stale-1")
    run("runs/finp_cnn/finp_ala/seed0", checkpoint=False)
    torn = run("runs/finp_cnn/finp_ala/seed1")
    (torn / "checkpoints" / "last.ckpt").write_bytes(b"PK\x03\x04 cut")
    said = index.park(work, committed)
    assert sorted(line.split()[0] for line in said) == ["left", "parked"], said  # left out: the torn checkpoint
    assert "finp_ala/seed1" in min(said) and "does not load" in min(said)
    parked = committed / "in_progress" / "runs/rcdpfl_paper/runs/mnist_paper_ifca_eps5_s1"
    assert sorted(str(p.relative_to(parked)) for p in parked.rglob("*") if p.is_file()) == [
        "checkpoints/last.ckpt", "config.yaml", "metrics.csv.gz", "privacy_ledger.jsonl.gz", "summary.json"]
    assert [p.name for p in (committed / "in_progress").rglob("last.ckpt")] == ["last.ckpt"]  # the cut one alone
    assert index.restore(fresh, committed, parked_too=False) == [] and not fresh.exists()  # a lent GPU
    said = index.restore(fresh, committed)
    assert said == [f"restored {fresh / 'runs/rcdpfl_paper/runs/mnist_paper_ifca_eps5_s1'} (parked: resumes from "
                    f"its last checkpoint)"]
    back = fresh / "runs/rcdpfl_paper/runs/mnist_paper_ifca_eps5_s1"
    for file in ("metrics.csv", "privacy_ledger.jsonl", "config.yaml", "checkpoints/last.ckpt"):
        assert (back / file).read_bytes() == (cut / file).read_bytes(), file
    assert resumable(back) and not (back / "run.lock").exists()
    (back / "summary.json").write_text(json.dumps({"status": "budget_spent"}))  # it finished next session
    said = index.add(fresh / "runs/rcdpfl_paper", committed / "rcdpfl_mnist")
    assert said == [f"removed its parked copy {parked}", f"added {committed / 'rcdpfl_mnist/ifca_eps5/seed1'}"]
    assert not parked.exists()
