"""The committed complete runs: add a harness's finished runs, and write ``index.csv``.

    python docs/complete_runs/index.py add --src runs/paper/table6 --dest docs/complete_runs/table6_fmnist
    python docs/complete_runs/index.py add --src runs/finp_cnn --dest docs/complete_runs/finp_fmnist
    python docs/complete_runs/index.py add --src runs/rcdpfl_paper --dest docs/complete_runs/rcdpfl_mnist
    python docs/complete_runs/index.py write          # docs/complete_runs/index.csv
    python docs/complete_runs/index.py restore        # the committed runs back into runs/ (a fresh checkout)

``add`` copies every finished run of a harness's tree to ``<dest>/<name>/seed<k>`` in the committed
form: ``config.yaml``, ``summary.json``, ``harness.json`` and ``sia.json`` when there are, and
``metrics.csv`` and ``privacy_ledger.jsonl`` gzipped. The three trees (:func:`harness_runs`):
a paper table's ``<src>/<column>/<method>/seed<k>`` (name ``<method>_<column>``), ``finp-table``'s
``<src>/<row>/seed<k>`` (name ``<row>``) and ``rcdpfl-table``'s
``<src>/runs/<dataset>_<method>_eps<ε>_s<k>`` (name ``<method>_eps<ε>``; a non-private method's
``<dataset>_<method>_s<k>``, name ``<method>``). A run that did not finish
(``status`` other than ``completed``/``budget_spent``) is left out, and said so, and so is a run
committed already under another name (the same ``--run_dir`` in its ``harness.json``).

``write`` lists every committed run directory (one holding ``summary.json``) under this folder,
one row each: ``table,dataset,method,seed,rounds,status,epsilon,path`` and what a reader needs to
trust the row: ``rounds_planned``, ``dp_valid``, ``evaluated_models_private``, ``accuracy``,
``accuracy_worst``, ``accelerator`` (the run's ``trainer.accelerator``: ``gpu`` for the runs made on
a lent GPU, ``auto`` or ``cpu`` for this project's CPU). ``table``
comes from the run's top folder (:data:`TABLES`): ``fedfdp-IV``, ``fedfdp-V``, ``fedfdp-VI``,
``rcdpfl``, ``finp``, or this project's own studies; ``dataset`` from the data class; ``method``
from the folder (the harness's method stem and column, or the study's row name); ``seed`` from
the config. ``tests/experiments/test_complete_runs.py`` checks the file against the runs it names.

``park`` keeps what a session could not finish: every unfinished harness run under ``runs/`` with a
checkpoint is copied to ``in_progress/<its run directory>`` (its files, logs gzipped, and only
``checkpoints/last.ckpt``, which must load); run it after the lanes are stopped. ``restore`` writes
these back too, so the next session resumes the run from its last round instead of its first, and
``add`` deletes a parked copy once its run is committed finished.

``restore`` is ``add`` backwards, for a checkout without the harness trees (``runs/`` is not
committed): every committed run whose ``harness.json`` names its run directory (``--run_dir``)
is written back there, logs unzipped, so that a harness command started again skips it instead of
training it again. A run directory that exists already is left as it is (and said so).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
import shutil
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
INDEX = HERE / "index.csv"
FIELDS = ["table", "dataset", "method", "seed", "rounds", "status", "epsilon", "path", "rounds_planned",
          "dp_valid", "evaluated_models_private", "accuracy", "accuracy_worst", "accelerator"]

#: top folder -> the table it reproduces (the seed papers') or the study it belongs to (this project's)
TABLES = {
    "table4_fmnist": "fedfdp-IV", "table4_mnist": "fedfdp-IV",
    "table5_fmnist": "fedfdp-V", "table6_fmnist": "fedfdp-VI",
    "rcdpfl_mnist": "rcdpfl", "rcdpfl_fmnist": "rcdpfl", "finp_fmnist": "finp",
    "issue23_fmnist10": "equal-budget-10clients", "issue23_fmnist50": "equal-budget-50clients",
    "ranked_fmnist10": "ranked-10clients", "ranked_fmnist50": "ranked-50clients",
    "ranked_fmnist10_dir0p5": "ranked-10clients-dir0.5",
    "population_fmnist": "population",
}
#: a data class's dataset, read with ``Clustered`` and ``DataModule`` stripped (:func:`dataset_name`)
DATASETS = {"FashionMNIST": "fmnist", "MNIST": "mnist", "CIFAR10": "cifar10", "Digits": "digits",
            "HAR": "har", "SyntheticHAR": "synthetic_har", "FEMNIST": "femnist"}
FINISHED = ("completed", "budget_spent")
#: where :func:`park` keeps the unfinished runs, under this folder
PARKED = "in_progress"
LAST_CHECKPOINT = "checkpoints/last.ckpt"


def _rcdpfl_name(name: str) -> tuple[str, int] | None:
    """``<dataset>_<method>_eps<ε>_s<k>`` (``rcdpfl-table``'s run folder) -> (``<method>_eps<ε>``, k);
    a non-private method's ``<dataset>_<method>_s<k>`` -> (``<method>``, k)."""
    from fedfdp.experiments.rcdpfl import LABELS

    stem, sep, seed = name.rpartition("_s")
    if not (sep and seed.isdigit()):
        return None
    head, sep_eps, eps = stem.rpartition("_eps")
    head, suffix = (head, f"_eps{eps}") if sep_eps else (stem, "")
    methods = [m for m in LABELS if head.endswith(f"_{m}")]
    if not methods:
        return None
    return f"{max(methods, key=len)}{suffix}", int(seed)


def harness_runs(src: Path) -> list[tuple[Path, str, str]]:
    """``(run_dir, name, seed folder)`` of every run (finished or not) of a harness tree ``src``:
    a paper table's, ``finp-table``'s or ``rcdpfl-table``'s (see the module docstring)."""
    found = [(s.parent, f"{s.parent.parent.name}_{s.parent.parent.parent.name}", s.parent.name)
             for s in src.glob("*/*/seed*/summary.json")]
    found += [(s.parent, s.parent.parent.name, s.parent.name) for s in src.glob("*/seed*/summary.json")]
    for s in src.glob("runs/*/summary.json"):
        parsed = _rcdpfl_name(s.parent.name)
        if parsed is not None:
            found.append((s.parent, parsed[0], f"seed{parsed[1]}"))
    return sorted(r for r in found if ".stale-" not in r[0].name)  # a run moved aside to start it again


def add(src: Path, dest: Path) -> list[str]:
    """Copy the finished runs of the harness tree ``src`` into ``dest``; lines saying what was done."""
    said = []
    # a run committed already under another name (a restored tree holds every committed run) is not
    # committed twice: keyed by the run directory it was trained in
    committed = {launched_run_dir(s.parent): s.parent for s in dest.parent.glob("*/*/seed*/summary.json")}
    committed.pop(None, None)  # committed without harness.json: not known by its run directory
    for run, name, seed in harness_runs(src):
        status = json.loads((run / "summary.json").read_text()).get("status")
        if status not in FINISHED:
            said.append(f"left out {run} (status {status})")
            continue
        target = dest / name / seed
        earlier = committed.get(_from_runs(run))
        if earlier is not None and earlier.resolve() != target.resolve():
            said.append(f"kept {run}: committed already as {earlier}")
            continue
        target.mkdir(parents=True, exist_ok=True)
        for file in ("config.yaml", "summary.json", "harness.json", "sia.json"):
            if (run / file).is_file():
                shutil.copyfile(run / file, target / file)
        for file in ("metrics.csv", "privacy_ledger.jsonl"):
            if (run / file).is_file():
                (target / f"{file}.gz").write_bytes(gzip.compress((run / file).read_bytes(), mtime=0))
        launched = _from_runs(run.absolute())
        parked = dest.parent / PARKED / launched if launched is not None else None
        if parked is not None and parked.is_dir():
            shutil.rmtree(parked)
            said.append(f"removed its parked copy {parked}")
        said.append(f"added {target}")
    return said


def launched_run_dir(committed: Path) -> Path | None:
    """The run directory (relative to the repository root) a committed run was trained in: the
    ``--run_dir`` of its ``harness.json`` (an absolute one from its ``runs/`` folder on); None when
    there is no ``harness.json`` (the studies committed before the harness recorded it)."""
    try:
        command = json.loads((committed / "harness.json").read_text())["command"]
        run_dir = Path(command[command.index("--run_dir") + 1])
    except (OSError, ValueError, KeyError, IndexError):
        return None
    return _from_runs(run_dir)


def _from_runs(run_dir: Path) -> Path | None:
    """A run directory as the harnesses name it, relative to the repository root: an absolute one
    from its ``runs/`` folder on (None when it has none)."""
    if not run_dir.is_absolute():
        return run_dir
    parts = run_dir.parts
    return Path(*parts[parts.index("runs"):]) if "runs" in parts else None


def restore(root: Path, committed_root: Path = HERE, *, parked_too: bool = True) -> list[str]:
    """Write every committed run under ``committed_root`` back to its run directory under ``root``
    (:func:`launched_run_dir`), and every parked one (:func:`park`) unless ``parked_too`` is off (a
    lent GPU: a CPU checkpoint cannot be resumed there with ``--trainer.accelerator gpu``, another
    configuration, so the GPU runs it afresh); lines saying what was done."""
    said = []
    copies = [(s.parent, launched_run_dir(s.parent)) for s in sorted(committed_root.glob("*/*/seed*/summary.json"))]
    parked = committed_root / PARKED
    copies += [(c.parent.parent, c.parent.parent.relative_to(parked))
               for c in sorted(parked.glob(f"**/{LAST_CHECKPOINT}")) if parked_too]
    for committed, run_dir in copies:
        if run_dir is None:
            continue
        target = root / run_dir
        if target.exists():
            said.append(f"kept {target} (exists)")
            continue
        shutil.copytree(committed, target)
        for file in target.glob("*.gz"):
            file.with_suffix("").write_bytes(gzip.decompress(file.read_bytes()))
            file.unlink()
        said.append(f"restored {target}" + (" (parked: resumes from its last checkpoint)" if committed.is_relative_to(parked) else ""))
    return said


def park(root: Path, committed_root: Path = HERE) -> list[str]:
    """Copy every unfinished run under ``root/runs`` that has a checkpoint to
    ``committed_root/in_progress/<run directory>`` (replacing an earlier parked copy); lines saying
    what was done. A run whose ``last.ckpt`` does not load (cut while it was written) is left out."""
    import torch

    said = []
    for checkpoint in sorted((root / "runs").glob(f"**/{LAST_CHECKPOINT}")):
        run = checkpoint.parent.parent
        if ".stale-" in str(run) or _finished(run):
            continue
        try:
            rounds = torch.load(checkpoint, map_location="cpu", weights_only=False).get("global_step")  # a step a round
        except Exception as err:  # noqa: BLE001 - any unreadable checkpoint is reported, not parked
            said.append(f"left out {run}: {checkpoint.name} does not load ({type(err).__name__})")
            continue
        target = committed_root / PARKED / run.relative_to(root)
        shutil.rmtree(target, ignore_errors=True)
        (target / LAST_CHECKPOINT).parent.mkdir(parents=True)
        shutil.copyfile(checkpoint, target / LAST_CHECKPOINT)
        for file in run.iterdir():
            # the lock is the killed process's; report.md (its plots are not copied) is rewritten when the run ends
            if file.is_file() and file.name not in ("run.lock", "report.md"):
                data = file.read_bytes()
                gz = file.name in ("metrics.csv",) or file.name.startswith("privacy_ledger")
                (target / (file.name + ".gz" if gz else file.name)).write_bytes(gzip.compress(data, mtime=0) if gz else data)
        said.append(f"parked {run} ({rounds} rounds done) in {target}")
    return said


def _finished(run: Path) -> bool:
    try:
        return json.loads((run / "summary.json").read_text()).get("status") in FINISHED
    except (OSError, ValueError):
        return False


def dataset_name(data_class: str) -> str:
    """The index's ``dataset`` of a data class: ``FashionMNISTDataModule`` and RC-DPFL's
    ``ClusteredFashionMNISTDataModule`` are ``fmnist``, the MNIST ones ``mnist`` (:data:`DATASETS`); a
    class it does not know keeps its name, which the index test refuses."""
    return DATASETS.get(data_class.removeprefix("Clustered").removesuffix("DataModule"), data_class or "unknown")


def row(run_dir: Path) -> dict[str, object]:
    """The index row of one committed run directory."""
    summary = json.loads((run_dir / "summary.json").read_text())
    config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    top = run_dir.relative_to(HERE).parts[0]
    data_class = str((config.get("data") or {}).get("class_path", "")).rsplit(".", 1)[-1]
    final = summary.get("final") or {}
    return {
        "table": TABLES.get(top, top), "dataset": dataset_name(data_class),
        "method": run_dir.parent.name, "seed": config.get("seed_everything"), "rounds": summary.get("rounds_run"),
        "status": summary.get("status", "completed" if summary.get("rounds_run") == summary.get("rounds_planned")
                              else "unknown"),
        "epsilon": summary.get("epsilon"), "path": str(run_dir.relative_to(HERE)),
        "rounds_planned": summary.get("rounds_planned"), "dp_valid": summary.get("dp_valid"),
        "evaluated_models_private": summary.get("evaluated_models_private"),
        "accuracy": final.get("accuracy"), "accuracy_worst": final.get("accuracy_worst"),
        "accelerator": (config.get("trainer") or {}).get("accelerator", "auto"),
    }


def write(path: Path = INDEX) -> int:
    """Write the index of every committed run under this folder; the number of rows."""
    runs = sorted(p.parent for p in HERE.glob("*/*/seed*/summary.json") if ".stale-" not in p.parent.name)
    rows = [row(run) for run in runs]
    # written aside and renamed: two queue lanes may write the index at the same moment
    staged = path.with_name(f".{path.name}.{os.getpid()}")
    with staged.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(staged, path)
    return len(rows)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("add", help="copy the finished runs of a harness tree (paper table, finp-table, rcdpfl-table) here")
    p.add_argument("--src", type=Path, required=True)
    p.add_argument("--dest", type=Path, required=True)
    sub.add_parser("write", help="write index.csv")
    for command, text in (("restore", "write the committed and parked runs back to their run directories (runs/...)"),
                          ("park", "copy the unfinished runs with a checkpoint to in_progress/ (after stopping them)")):
        p = sub.add_parser(command, help=text)
        p.add_argument("--root", type=Path, default=HERE.parent.parent, help="the repository root (default: this one)")
        if command == "restore":
            p.add_argument("--finished-only", action="store_true", help="not the parked runs (a lent GPU runs them afresh)")
    args = parser.parse_args(argv)
    if args.command in ("add", "restore", "park"):
        said = {"add": lambda: add(args.src, args.dest),
                "restore": lambda: restore(args.root, parked_too=not args.finished_only),
                "park": lambda: park(args.root)}[args.command]()
        for line in said:
            print(line)
        return 0
    print(f"wrote {INDEX} ({write()} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
