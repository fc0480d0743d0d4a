"""Flower for the tests: real processes on 127.0.0.1 (a SuperLink, SuperNodes, ``flwr run``) and an
in-process grid (:class:`InProcessGrid`: the server strategy and the ClientApp in one process).

Every process is started in its own session (process group) with a time bound, and
:meth:`Deployment.stop` ends the groups it started (SIGTERM, then SIGKILL) — a SuperNode's
``flower-superexec`` and ClientApp processes included.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fedfdp.fit import main as fit_main
from fedfdp.privacy.accounting import epsilon_of
from tests.conftest import REPO

#: the tiny configs of the deployment tests (tests/configs/), each run for ROUNDS rounds
CONFIGS = {name: REPO / "tests" / "configs" / f"tiny_{name}.yaml"
           for name in ("dpfedavg", "fedfdp", "dpscaffold", "dpditto", "client_dp")}
ROUNDS = 3
#: a run of ROUNDS rounds, evaluated once at the end (every evaluation is one more message per node)
OVERRIDES = f"--model.num_rounds {ROUNDS} --model.eval_every 10 --wandb disabled"
#: between ε after 2 rounds (3.50) and after 3 rounds (3.97) of FedFDP in the tiny config
TIGHT_TARGET = 3.7


def simulate(name: str | Path, run_dir: Path) -> Path:
    """The simulation of a tiny config (a name of CONFIGS or a path) for ROUNDS rounds in ``run_dir``."""
    config = CONFIGS[name] if isinstance(name, str) else name
    assert fit_main(["--config", str(config), *OVERRIDES.split(), "--run_dir", str(run_dir)]) == 0
    return run_dir


def global_model(run_dir: Path) -> dict[str, torch.Tensor]:
    """The global model of a run's last checkpoint."""
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("global_model.")}


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of max |a - b| / max |a|."""
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-12)) for k in a)


def client_epsilons(entries, run: str | None = None) -> dict[int, float]:
    """Each client's ε (δ 1e-5) over ledger entries (of one run when ``run`` is given)."""
    chosen = [e for e in entries if run is None or e.run == run]
    return {c: epsilon_of([e.event for e in chosen if e.client == c], 1e-5) for c in sorted({e.client for e in chosen})}


def grid_nodes(ledgers: Path, targets: dict[int, float] | None = None) -> dict[int, dict]:
    """The node configs of 3 in-process nodes (node ids 100-102, partitions 0-2) for :class:`InProcessGrid`."""
    configs = {}
    for cid in range(3):
        config = {"partition-id": cid, "num-partitions": 3, "ledger-dir": str(ledgers), "secure-rng": False}
        if targets and cid in targets:
            config["target-epsilon"] = targets[cid]
        configs[100 + cid] = config
    return configs


def upload_rows(run_dir: Path) -> list[dict[str, str]]:
    """The rows of a run's metrics.csv that record a round's uploads."""
    with open(run_dir / "metrics.csv") as f:
        return [row for row in csv.DictReader(f) if row.get("clients_uploaded")]


APP = REPO / "examples" / "flower_app"
BIN = Path(sys.executable).parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_config(**values: object) -> str:
    """``--node-config`` text: strings quoted, booleans lower-case (TOML values)."""
    parts = []
    for key, value in values.items():
        text = str(value).lower() if isinstance(value, bool) else f"'{value}'" if isinstance(value, str) else str(value)
        parts.append(f"{key.replace('_', '-')}={text}")
    return " ".join(parts)


def _wire(message):  # type: ignore[no-untyped-def]
    """``message`` as it arrives after Flower's wire encoding (protobuf out and back)."""
    from flwr.common.serde import message_from_proto, message_to_proto

    return message_from_proto(message_to_proto(message))


class InProcessGrid:
    """A SuperLink stand-in: each message goes to this process's ClientApp with its node's config,
    and each message and reply through Flower's wire encoding.

    Each node keeps one Flower ``Context`` for the run (its ``context.state`` lives as long as
    the SuperNode); ``restart_before`` lists the rounds (0-based) before which every node
    restarts with an empty ``context.state`` (its files stay), as after a SuperNode restart.
    ``silent`` nodes never answer from round ``silent_from`` (a node that died before it released).
    ``lost`` nodes die at round ``silent_from`` and the SuperLink notices, as Flower's does once a
    node misses its heartbeats: it stops listing them and answers their messages itself with a
    ``NODE_UNAVAILABLE`` error. ``restarts`` maps a lost node to the new node id it comes back
    under right after (same node config, hence the same partition, state file and ledger).
    """

    def __init__(self, node_configs: dict[int, dict], silent: set[int] = frozenset(), silent_from: int = 0,
                 lost: set[int] = frozenset(), restart_before: set[int] = frozenset(),
                 restarts: dict[int, int] | None = None) -> None:
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 0, 1
        self.node_configs, self.silent, self.silent_from = node_configs, set(silent), silent_from
        self.lost, self.gone, self.restarts = set(lost), set(), dict(restarts or {})
        self.restart_before, self.restarted = set(restart_before), set()
        self.contexts: dict[int, object] = {}
        self.replies: dict[str, object] = {}

    def get_node_ids(self) -> list[int]:
        return [n for n in self.node_configs if n not in self.gone]

    def _context(self, node: int, round_idx: int | None):  # type: ignore[no-untyped-def]
        from flwr.app import Context, RecordDict

        if round_idx is not None and round_idx in self.restart_before and (node, round_idx) not in self.restarted:
            self.restarted.add((node, round_idx))
            self.contexts.pop(node, None)
        if node not in self.contexts:
            self.contexts[node] = Context(run_id=7, node_id=node, node_config=self.node_configs[node],
                                          state=RecordDict(), run_config={})
        return self.contexts[node]

    def push_messages(self, messages) -> list[str]:  # type: ignore[no-untyped-def]
        from flwr.app import Message
        from flwr.app.error import Error
        from flwr.common.constant import ErrorCode

        from fedfdp.flower import protocol
        from fedfdp.flower.client_app import app as client_app

        ids = []
        for message in messages:
            ids.append(message.object_id)
            node = message.metadata.dst_node_id
            train = message.metadata.message_type == protocol.TRAIN
            round_idx = protocol.TrainRequest.decode(message.content).round if train else None
            late = train and round_idx >= self.silent_from
            if node in self.lost and late:
                self.gone.add(node)
                if node in self.restarts:  # back under a new id: listed from the next call on
                    self.node_configs.setdefault(self.restarts[node], self.node_configs[node])
                reply = Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason="Error: Node Unavailable"),
                                reply_to=message)
                reply.metadata.__dict__["_src_node_id"] = 1  # the SuperLink answers, not the node
                reply.metadata.__dict__["_reply_to_message_id"] = message.object_id
                self.replies[message.object_id] = reply
                continue
            if node in self.silent and late:
                continue
            try:
                reply = _wire(client_app(_wire(message), self._context(node, round_idx)))
            except Exception as err:  # what flwr-clientapp turns into an error reply
                reply = Message(Error(code=1, reason=str(err)), reply_to=message)
            reply.metadata.__dict__["_reply_to_message_id"] = message.object_id  # the SuperLink's message id
            self.replies[message.object_id] = reply
        return ids

    def pull_messages(self, message_ids) -> list:  # type: ignore[no-untyped-def]
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]


@dataclass
class FlowerRun:
    """One finished ``flwr run``: its id, status (``flwr ls``), output and wall time."""

    run_id: str
    status: str
    output: str
    seconds: float


@dataclass
class Deployment:
    """A SuperLink and its SuperNodes, all children of this test process."""

    root: Path
    tls: bool = False
    auth: bool = False
    port: int = field(default_factory=free_port)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.home = self.root / "flwr_home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.certs = self.root / "certs"
        self.env = {**os.environ, "FLWR_HOME": str(self.home), "FLWR_TELEMETRY_ENABLED": "0",
                    "FLWR_DISABLE_UPDATE_CHECK": "1", "WANDB_MODE": "disabled", "OMP_WAIT_POLICY": "PASSIVE",
                    "OMP_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                    # the ServerApp and ClientApp processes import this checkout's fedfdp, not whichever
                    # checkout the environment's editable install points at
                    "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        self.env.pop("FEDFDP_RUN_DIR", None)
        if self.tls:
            self._make_certificates()
        connection = [f'address = "127.0.0.1:{self.port}"']
        connection.append(f'root-certificates = "{self.certs / "ca.crt"}"' if self.tls else "insecure = true")
        (self.home / "config.toml").write_text('[superlink]\ndefault = "test"\n\n[superlink.test]\n'
                                               + "\n".join(connection) + "\n")

    # ---- certificates and keys ----------------------------------------------------------------
    def _make_certificates(self) -> None:
        """A CA and a server certificate for 127.0.0.1 (openssl)."""
        c = self.certs
        c.mkdir(parents=True, exist_ok=True)
        run = [["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", c / "ca.key", "-out", c / "ca.crt", "-days",
                "1", "-subj", "/CN=fedfdp test CA"],
               ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", c / "server.key", "-out", c / "server.csr", "-subj",
                "/CN=127.0.0.1"]]
        (c / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        run.append(["x509", "-req", "-in", c / "server.csr", "-CA", c / "ca.crt", "-CAkey", c / "ca.key",
                    "-CAcreateserial", "-out", c / "server.pem", "-days", "1", "-extfile", c / "san.ext"])
        for args in run:
            subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)

    def make_key(self, name: str) -> Path:
        """An ECDSA P-384 key pair for SuperNode authentication; the private key's path."""
        key = self.root / "keys" / name
        key.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-f", str(key)], check=True,
                       capture_output=True, timeout=60)
        return key

    def register(self, key: Path) -> None:
        """``flwr supernode register KEY.pub test``."""
        proc = self.flwr("supernode", "register", str(key) + ".pub", "test", timeout=120)
        assert proc.returncode == 0 and "registered" in proc.stdout, proc.stdout + proc.stderr

    # ---- processes ------------------------------------------------------------------------------
    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(args, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs[name] = proc
        return proc

    def start_superlink(self) -> None:
        """``flower-superlink`` on :attr:`port` (TLS and node authentication when asked)."""
        args = [str(BIN / "flower-superlink"), "--disable-runtime-dependency-installation", "--port", str(self.port)]
        if self.tls:
            args += ["--ssl-ca-certfile", str(self.certs / "ca.crt"), "--ssl-certfile", str(self.certs / "server.pem"),
                     "--ssl-keyfile", str(self.certs / "server.key")]
        else:
            args.append("--insecure")
        if self.auth:
            args.append("--enable-supernode-auth")
        self._start("superlink", args)
        deadline = time.monotonic() + 60
        while "Uvicorn running" not in self.log("superlink"):
            assert self.procs["superlink"].poll() is None, self.log("superlink")[-3000:]
            assert time.monotonic() < deadline, "the SuperLink did not start within 60 s"
            time.sleep(0.2)

    def start_supernode(self, name: str, config: str, key: Path | None = None) -> subprocess.Popen:
        """``flower-supernode`` with its own local port and ``--node-config config``.

        Returns once the node listens on its port, so that the next :func:`free_port` cannot hand
        out the same port (it is free until the node binds it: two nodes started back to back
        could draw the same one). A node that loses its port to another process anyway is
        started again on a new one.
        """
        for _ in range(3):
            args = [str(BIN / "flower-supernode"), "--superlink", f"127.0.0.1:{self.port}", "--port",
                    str(free_port()), "--node-config", config]
            args += ["--root-certificates", str(self.certs / "ca.crt")] if self.tls else ["--insecure"]
            if key is not None:
                args += ["--auth-supernode-private-key", str(key)]
            proc = self._start(name, args)
            deadline = time.monotonic() + 60
            while "Uvicorn running" not in self.log(name) and proc.poll() is None:
                assert time.monotonic() < deadline, f"SuperNode {name} did not start within 60 s: {self.log(name)[-3000:]}"
                time.sleep(0.1)
            if "Uvicorn running" in self.log(name):
                return proc
            assert "address already in use" in self.log(name), self.log(name)[-3000:]
        raise AssertionError(f"SuperNode {name} found no free port in 3 tries")

    def start_seeded(self, clients: int = 3, target_epsilon: float | None = None) -> None:
        """The SuperLink and one SuperNode per client with seeded noise (``secure-rng=false``: the
        equivalence with the simulation), ledgers under ``root/ledgers``. ``target_epsilon``: each
        node's own budget, which every run on the node spends (default: each run's target)."""
        self.start_superlink()
        budget = {} if target_epsilon is None else {"target_epsilon": target_epsilon}
        for cid in range(clients):
            self.start_supernode(f"node{cid}", node_config(partition_id=cid, num_partitions=clients,
                                                           ledger_dir=str(self.root / "ledgers"), secure_rng=False,
                                                           **budget))

    def log(self, name: str) -> str:
        """What process ``name`` wrote so far."""
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def flwr(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """The ``flwr`` command line with this deployment's ``FLWR_HOME``."""
        return subprocess.run([str(BIN / "flwr"), *args], cwd=REPO, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def run_app(self, run_config: str, timeout: float = 400) -> FlowerRun:
        """``flwr run examples/flower_app test --stream --run-config ...``, then its status from ``flwr ls``.

        ``flwr run --stream`` exits 0 even when the ServerApp failed: the status is what counts.
        """
        start = time.monotonic()
        proc = self.flwr("run", str(APP), "test", "--stream", "--run-config", run_config, timeout=timeout)
        seconds = time.monotonic() - start
        output = proc.stdout + proc.stderr
        found = re.search(r"Successfully started run (\d+)", output)
        assert found, output[-3000:]
        run_id = found.group(1)
        listing = self.flwr("ls", "test", "--run-id", run_id, "--format", "json", timeout=60)
        runs = json.loads(listing.stdout)["runs"]
        return FlowerRun(run_id=run_id, status=runs[0]["status"], output=output, seconds=seconds)

    def kill_group(self, name: str) -> None:
        """SIGKILL process ``name`` and everything it started (its process group)."""
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def processes_in_group(self, name: str, command: str) -> list[int]:
        """Pids of the processes in ``name``'s process group whose command line contains ``command``."""
        group = self.procs[name].pid
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.getpgid(int(entry)) != group:
                    continue
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, ProcessLookupError):
                continue
            if command in cmdline:
                pids.append(int(entry))
        return pids

    def stop(self) -> None:
        """End every process group this deployment started (SIGTERM, SIGKILL after 10 s)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():  # the groups: superexec and ClientApp processes too
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if proc.poll() is None:
                proc.wait(timeout=30)


def tools_missing() -> list[str]:
    """The command-line tools the secure deployment needs that are not installed."""
    return [tool for tool in ("openssl", "ssh-keygen") if shutil.which(tool) is None]
