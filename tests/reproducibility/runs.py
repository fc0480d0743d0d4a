"""Reference runs whose digests pin fedfdp's results bit for bit (tests/reproducibility/digests.json).

Each case is a 20-round run through the real command line (``python -m fedfdp.fit``, or
``python -m fedfdp.experiments sweep`` for the sweep case) in a subprocess with one thread
(``OMP_NUM_THREADS=1``, so float reductions do not depend on the core count). Its digest:

* ``model_sha256``: the global model (``state_dict`` entries ``global_model.*``) of
  ``checkpoints/last.ckpt``, keys sorted, each as key, dtype, shape and raw little-endian bytes;
* ``state_sha256`` and ``tensors``: the same over every tensor anywhere in the checkpoint (the
  client's scratch model, an EMA, an algorithm's server and client stores: SCAFFOLD's control
  variates, Ditto's personal models, FedDyn's gradient memories, RC-DPFL's cluster models, ...),
  but for ``ModelCheckpoint``'s bookkeeping; ``tensors`` holds each one's sha256 (16 hex digits)
  so that a mismatch names the tensor;
* ``algorithm_state`` and ``callback_state``: sha256 (16 hex digits) of the canonical JSON of the
  checkpoint's non-tensor state, per entry of the federation's state (``algorithm/...``: FedFDP's
  broadcast loss, RC-DPFL's cluster assignment and posteriors, FinP's ρ, ...) and per callback
  (the loss releases' clip bounds, the source inference audit's history, ...); left out:
  ``RunSummary`` (wall clock), ``ModelCheckpoint`` (paths) and ``RDPAccounting`` (its copy of the
  privacy ledger, pinned below through the ledger file, ε and ``dp_valid``);
* ``data_fingerprint``: the data module's fingerprint of the split, from the checkpoint;
* ``ledger_sha256``, ``ledger_records``, ``ledger_kinds``, ``ledger_fields``: the privacy ledger
  (``privacy_ledger.jsonl``), each record as canonical JSON (sorted keys) in file order, any
  time-, path- or process-dependent field dropped (the format has none today);
* ``epsilon``, ``delta``, ``final_accuracy`` (``repr`` of the float), ``dp_valid``,
  ``evaluated_models_private``, ``rounds_run``, ``status`` from ``summary.json``;
* ``metrics_sha256``, ``metrics_rows``, ``metrics_columns``: ``metrics.csv``'s values as written,
  wall-clock columns (``round_seconds``, ...) dropped; ``metrics_columns`` holds each column's
  sha256 (16 hex digits).

When a run is compared with a reference (:func:`digest_run` with ``like``), the aggregate hashes
are taken over the reference's columns, tensors and ledger fields, so what a new version adds
(a metric column, a tensor in the checkpoint, a ledger field) is reported but does not fail the
comparison; anything the reference has must be reproduced exactly.

``python -m tests.reproducibility.runs --write`` (from the repository root) recomputes every case
and rewrites digests.json; ``--case NAME`` (repeatable) recomputes those cases only (and, with
``--write``, updates their entries); without ``--write`` it compares them with digests.json.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
DIGESTS = Path(__file__).with_name("digests.json")
ROUNDS = 20
# one thread: float results must not depend on the machine's core count
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
       "OMP_WAIT_POLICY": "PASSIVE", "WANDB_MODE": "disabled"}

# wall-clock columns of metrics.csv / keys of the checkpoint and ledger, dropped from the digest
WALL_CLOCK = re.compile(r"(second|time|wall|throughput|per_sec|memory|_mb$|clock|duration|elapsed|timestamp)", re.I)
# callbacks whose checkpoint state is left out: wall clock and paths (RunSummary, ModelCheckpoint), and
# the accountant's copy of the privacy ledger (pinned by the ledger file, ε and dp_valid; its
# checkpoint layout is not a result)
SKIPPED_CALLBACKS = ("RunSummary", "ModelCheckpoint", "RDPAccounting")
# ledger record fields that name a process, a path or a moment (none in today's format)
LEDGER_VOLATILE = {"time", "timestamp", "ts", "wall", "pid", "host", "hostname", "path", "file", "created", "date"}


@dataclass(frozen=True)
class Case:
    """One reference run.

    Args:
        name: the case's name (digests.json key, test id).
        config: the config, relative to the repository root.
        overrides: command-line overrides after ``--model.num_rounds 20``; each is explained in ``why``.
        why: why the overrides are there (none of them changes training).
        sweep_seeds: run ``python -m fedfdp.experiments sweep`` over these seeds instead of one fit.
        group: which test file runs it (``test_digests.py`` takes group "a", ... ; see there).
    """

    name: str
    config: str
    overrides: tuple[str, ...] = ()
    why: str = ""
    sweep_seeds: tuple[int, ...] | None = None
    group: str = "a"


# Overrides that leave training alone (checked: the model, checkpoint state, ledger and ε are those
# of the run without them): evaluation only at the last round and on the test splits only.
FAST_EVAL = ("--model.eval_every", "20", "--model.eval_train_splits", "false")
FAST_EVAL_WHY = "evaluation at round 20 only, test splits only (the config's evaluation made the run > 60 s)"

# Seconds each (2-core machine, one thread, commit aab08f7): fedfdp 71, dpfedavg 60, dpfedavg_stacked_on 44,
# dpfedavg_stacked_off 44, fedfdp_fairagg 55, dpscaffold 62, dpditto 80, rcdpfl_digits 26, finp_dp 32,
# sweep_dpfedavg 117, dpfedprox 44, qffl_dp 52, dpfeddyn 44: about 4 minutes per group. Without FAST_EVAL
# fedfdp_fairagg took 74 s, dpditto 103, the sweep 162, dpfedprox 61, qffl_dp 74, dpfeddyn 72.
# Found while pinning them: at 20 rounds fedfdp's global model is bit-identical to dpfedavg's (C = 0.1
# clips every sample, so the fair factor does not act), and dpfedprox's to dpfedavg_stacked_off's (one
# local step: the proximal term is zero; DP-FedProx runs client by client); the sweep's runs are
# bit-identical to the runs alone (stacked path, one thread).
CASES: list[Case] = [
    # the main job and its baseline, as shipped
    Case("fedfdp", "configs/fmnist.yaml", group="a"),
    Case("dpfedavg", "configs/fmnist_dpfedavg.yaml", group="a"),
    # both execution paths of a one-step private round (stacked_round defaults to true)
    Case("dpfedavg_stacked_on", "configs/fmnist_dpfedavg.yaml", ("--model.stacked_round", "true", *FAST_EVAL),
         why="stacked rounds explicitly on (the default); " + FAST_EVAL_WHY, group="a"),
    Case("dpfedavg_stacked_off", "configs/fmnist_dpfedavg.yaml", ("--model.stacked_round", "false", *FAST_EVAL),
         why="stacked rounds off: the client-by-client path; " + FAST_EVAL_WHY, group="b"),
    Case("fedfdp_fairagg", "configs/fmnist_fedfdp_fairagg.yaml", FAST_EVAL, why=FAST_EVAL_WHY, group="c"),
    Case("dpscaffold", "configs/fmnist_scaffold_dp.yaml", group="c"),
    Case("dpditto", "configs/fmnist_ditto_dp.yaml", FAST_EVAL, why=FAST_EVAL_WHY, group="c"),
    Case("rcdpfl_digits", "configs/rcdpfl/digits_rcdpfl.yaml", group="a"),
    Case("finp_dp", "configs/finp_fmnist_dp.yaml", group="a"),
    # two runs trained together in one process (python -m fedfdp.experiments sweep)
    Case("sweep_dpfedavg", "configs/fmnist_dpfedavg.yaml", FAST_EVAL, why=FAST_EVAL_WHY, sweep_seeds=(0, 1),
         group="b"),
    Case("dpfedprox", "configs/fmnist_fedprox_dp.yaml", FAST_EVAL, why=FAST_EVAL_WHY, group="b"),
    Case("qffl_dp", "configs/fmnist_qffl_dp.yaml", FAST_EVAL, why=FAST_EVAL_WHY, group="b"),
    Case("dpfeddyn", "configs/fmnist_feddyn_dp.yaml", FAST_EVAL, why=FAST_EVAL_WHY, group="c"),
]
BY_NAME = {c.name: c for c in CASES}


# ---- running --------------------------------------------------------------------------------------
def command(case: Case, out: Path) -> list[str]:
    """The command line of ``case`` writing into ``out`` (a run directory, or a sweep's folder)."""
    rounds = ["--model.num_rounds", str(ROUNDS)]
    if case.sweep_seeds is not None:
        return [sys.executable, "-m", "fedfdp.experiments", "sweep", "--config", case.config,
                "--seeds", *map(str, case.sweep_seeds), "--out", str(out), "--fit-args", *rounds, *case.overrides]
    return [sys.executable, "-m", "fedfdp.fit", "--config", case.config, "--run_dir", str(out), *rounds,
            *case.overrides]


def run_case(case: Case, workdir: Path, like: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run ``case`` under ``workdir`` (with the code of the checkout this file is in) and return its
    digest: one run's fields, or ``{run name: fields}`` for a sweep. ``like``: the reference digest
    (see :func:`digest_run`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / case.name
    log = workdir / f"{case.name}.log"
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = command(case, out)
    logger.info("%s: %s", case.name, " ".join(cmd[1:]))
    start = time.monotonic()
    with log.open("w") as f:
        code = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    seconds = time.monotonic() - start
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"case {case.name}: exit status {code} after {seconds:.0f} s ({' '.join(cmd[1:])}):\n{tail}")
    logger.info("%s: finished in %.1f s", case.name, seconds)
    if case.sweep_seeds is None:
        return digest_run(out, like)
    index = json.loads((out / "sweep.json").read_text())
    bad = [(e["name"], e["status"]) for e in index if e["status"] != 0]
    if bad:
        raise RuntimeError(f"case {case.name}: sweep runs failed: {bad}")
    return {e["name"]: digest_run(out / e["name"], (like or {}).get(e["name"])) for e in index}


# ---- digests --------------------------------------------------------------------------------------
def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tensor_bytes(key: str, t: torch.Tensor) -> bytes:
    """key, dtype, shape and the raw little-endian bytes of ``t``."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        raw = t.view(torch.int16).numpy().astype("<i2").tobytes()
    else:
        a = t.numpy()
        raw = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
    head = f"{key}\0{str(t.dtype)}\0{tuple(t.shape)}\0".encode()
    return head + raw


def _tensors(obj: Any, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor under ``obj`` (dicts, lists, tuples), by path."""
    found: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        found[path] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            found.update(_tensors(v, f"{path}/{k}" if path else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found.update(_tensors(v, f"{path}[{i}]"))
    return found


def _checkpoint_tensors(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint but ModelCheckpoint's bookkeeping and wall-clock entries."""
    out = {}
    for path, t in _tensors(ckpt).items():
        if path.startswith(tuple(f"callbacks/{name}" for name in SKIPPED_CALLBACKS)) or WALL_CLOCK.search(path):
            continue
        out[path] = t
    return out


def _hash_tensors(tensors: dict[str, torch.Tensor], keys: list[str]) -> str:
    h = hashlib.sha256()
    for k in keys:
        h.update(_tensor_bytes(k, tensors[k]) if k in tensors else f"{k}\0<missing>\0".encode())
    return h.hexdigest()


def _canonical(obj: Any) -> Any:
    """``obj`` with tensors replaced by a marker (they are hashed on their own), for canonical JSON."""
    if isinstance(obj, torch.Tensor):
        return "<tensor>"
    if isinstance(obj, dict):
        return {str(k): _canonical(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    return obj


def _state_hashes(ckpt: dict[str, Any]) -> tuple[dict[str, str], dict[str, str], str | None]:
    """(the algorithm's and federation's non-tensor state, each callback's non-tensor state, the data
    split's fingerprint) of a checkpoint; the states as sha256 (16 hex digits) of canonical JSON."""
    def sha(v: Any) -> str:
        return _sha(json.dumps(_canonical(v), sort_keys=True, default=repr).encode())[:16]

    fed = ckpt.get("fedfdp") or {}
    algorithm = {f"algorithm/{k}": sha(v) for k, v in (fed.get("algorithm") or {}).items()}
    algorithm.update({k: sha(v) for k, v in fed.items() if k != "algorithm"})
    callbacks = {name: sha(state) for name, state in (ckpt.get("callbacks") or {}).items()
                 if not name.startswith(SKIPPED_CALLBACKS)}
    fingerprint = next((v["fingerprint"] for v in ckpt.values() if isinstance(v, dict) and "fingerprint" in v), None)
    return dict(sorted(algorithm.items())), dict(sorted(callbacks.items())), fingerprint


def _ledger_records(run_dir: Path) -> list[dict[str, Any]]:
    files = [run_dir / "privacy_ledger.jsonl", *sorted(run_dir.glob("privacy_ledger.rank*.jsonl"))]
    records = []
    for f in files:
        if f.exists():
            records += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return records


def _metrics(run_dir: Path) -> dict[str, list[str]]:
    with (run_dir / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    columns = list(rows[0]) if rows else []
    return {c: [r.get(c) or "" for r in rows] for c in columns}


def _column_sha(name: str, values: list[str]) -> str:
    return _sha((name + "\0" + "\n".join(values)).encode())


def digest_run(run_dir: Path, like: dict[str, Any] | None = None) -> dict[str, Any]:
    """The digest of one finished run directory (module docstring).

    ``like``: a reference digest of the same run; the aggregate hashes are then taken over its
    tensors, metric columns and ledger fields (what this run has in addition is left out of
    them, and stays in ``tensors`` / ``metrics_columns``).
    """
    summary = json.loads((run_dir / "summary.json").read_text())
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    tensors = _checkpoint_tensors(ckpt)
    algorithm_state, callback_state, fingerprint = _state_hashes(ckpt)
    model_keys = sorted(k for k in tensors if k.startswith("state_dict/global_model."))
    state_keys = sorted(like["tensors"]) if like else sorted(tensors)

    records = _ledger_records(run_dir)
    if like:
        fields = like["ledger_fields"].split(",") if like["ledger_fields"] else []
    else:
        fields = sorted({k for r in records for k in r} - LEDGER_VOLATILE)
    canonical = [json.dumps({k: r[k] for k in fields if k in r}, sort_keys=True, separators=(",", ":"))
                 for r in records]
    kinds: dict[str, int] = {}
    for r in records:
        kinds[str(r.get("kind"))] = kinds.get(str(r.get("kind")), 0) + 1

    metrics = _metrics(run_dir)
    kept = {c: v for c, v in metrics.items() if not WALL_CLOCK.search(c)}
    columns = sorted(like["metrics_columns"]) if like else sorted(kept)
    h = hashlib.sha256()
    for c in columns:
        h.update((_column_sha(c, kept[c]) if c in kept else f"{c}\0<missing>").encode() + b"\n")
    rows = len(next(iter(metrics.values()))) if metrics else 0

    def _float(x: Any) -> str | None:
        return None if x is None else repr(float(x))

    return {
        "status": summary.get("status"),
        "rounds_run": summary.get("rounds_run"),
        "epsilon": _float(summary.get("epsilon")),
        "delta": _float(summary.get("delta")),
        "dp_valid": summary.get("dp_valid"),
        "evaluated_models_private": summary.get("evaluated_models_private"),
        "final_accuracy": _float((summary.get("final") or {}).get("accuracy")),
        "model_sha256": _hash_tensors(tensors, model_keys),
        "model_tensors": len(model_keys),
        "state_sha256": _hash_tensors(tensors, state_keys),
        "tensors": {k: _sha(_tensor_bytes(k, t))[:16] for k, t in sorted(tensors.items())},
        "algorithm_state": algorithm_state,
        "callback_state": callback_state,
        "data_fingerprint": fingerprint,
        "ledger_sha256": _sha("\n".join(canonical).encode()),
        "ledger_records": len(records),
        "ledger_kinds": dict(sorted(kinds.items())),
        "ledger_fields": ",".join(f for f in fields if any(f in r for r in records)),
        "metrics_sha256": h.hexdigest(),
        "metrics_rows": rows,
        "metrics_columns": {c: _column_sha(c, v)[:16] for c, v in sorted(kept.items())},
    }


# ---- comparing ------------------------------------------------------------------------------------
def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists and scalars are leaves)."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def differences(reference: dict[str, Any], actual: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(fields of ``reference`` that ``actual`` lacks or differs in, fields only ``actual`` has)."""
    ref, act = flatten(reference), flatten(actual)
    missing = object()
    differ = [f"{k}: reference {ref[k]!r}, got {act.get(k, '<missing>')!r}"
              for k in ref if act.get(k, missing) != ref[k]]
    added = [k for k in act if k not in ref]
    return differ, added


def load_digests() -> dict[str, Any]:
    """digests.json: ``{case name: digest}``."""
    return json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}


def check_case(name: str, workdir: Path) -> None:
    """Run case ``name`` under ``workdir`` and assert its digest is the stored one, field by field
    (what the run has beyond the reference is logged, not failed)."""
    stored = load_digests()
    assert name in stored, (f"case {name}: no digest in {DIGESTS.name}; compute it from the reference "
                            f"commit with python -m tests.reproducibility.runs --write --case {name}")
    digest = run_case(BY_NAME[name], workdir, stored[name])
    differ, added = differences(stored[name], digest)
    if added:
        logger.warning("case %s: not in the reference (ignored): %s", name, ", ".join(added))
    assert not differ, (f"case {name} ({BY_NAME[name].config}): {len(differ)} digest field(s) differ from "
                        f"{DIGESTS.name}:\n  " + "\n  ".join(differ[:60]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.reproducibility.runs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite digests.json with the digests computed")
    parser.add_argument("--case", action="append", choices=list(BY_NAME), help="only this case (repeatable)")
    parser.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary folder, removed)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info("code under test: %s", REPO)
    names = args.case or [c.name for c in CASES]
    stored = load_digests()
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="fedfdp-digests-"))
    results, failed, seconds = {}, [], {}
    try:
        for name in names:
            start = time.monotonic()
            digest = run_case(BY_NAME[name], workdir, None if args.write else stored.get(name))
            seconds[name] = round(time.monotonic() - start, 1)
            results[name] = digest
            if not args.write:
                if name not in stored:
                    failed.append(name)
                    logger.error("%s: no stored digest", name)
                    continue
                differ, added = differences(stored[name], digest)
                if differ:
                    failed.append(name)
                    logger.error("%s: differs from digests.json:\n  %s", name, "\n  ".join(differ))
                if added:
                    logger.warning("%s: not in the reference (ignored): %s", name, ", ".join(added))
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    logger.info("seconds per case: %s", seconds)
    if args.write:
        merged = {**stored, **results} if args.case else results
        merged = {c.name: merged[c.name] for c in CASES if c.name in merged}
        DIGESTS.write_text(json.dumps(merged, indent=1, sort_keys=False) + "\n")
        print(f"wrote {len(results)} case(s) to {DIGESTS}")
        return 0
    print(f"{len(names) - len(failed)} of {len(names)} case(s) match digests.json"
          + (f"; differ: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
