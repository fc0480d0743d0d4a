"""The Flower ServerApp (``fedfdp.flower.server_app:app``): one fedfdp run over a SuperLink's nodes.

Run config (``flwr run APP CONNECTION --run-config "config='configs/x.yaml' ..."``):

``config``
    the run's YAML config, the same file ``python -m fedfdp.fit --config`` reads; a relative
    path is taken from the SuperLink's working directory, else from the fedfdp checkout.
``overrides``
    extra ``fedfdp.fit`` options, e.g. ``"--model.num_rounds 3 --wandb disabled"``.
``run-dir``
    the run directory (default ``runs/<config name>/<timestamp>`` under the SuperLink's
    working directory): ``config.yaml``, ``metrics.csv``, ``summary.json``, ``report.md``,
    checkpoints and W&B, as in a simulation.
``round-timeout``
    seconds to wait for the nodes' replies to one message round; a node that has not answered
    by then is left out of the round and not asked again while the SuperLink lists it; a node
    that connects later for the same partition takes its client over at the next message round
    (:mod:`fedfdp.flower.roster`).
``straggler-timeout``
    seconds to wait, once the first reply of a message round is in, for the others (0: no such
    limit, only ``round-timeout``); a client that misses it is left out like one that times out.
``node-wait``
    seconds to wait at start until one SuperNode per client has connected.
``ckpt-path``
    ``'last'`` (or a checkpoint file) continues the run in ``run-dir`` from its last checkpoint,
    as ``python -m fedfdp.fit --run_dir DIR --ckpt_path last`` does: the same checks (a resume
    that would change the run is refused and changes no file), metrics and summary appended, the
    server's ledger continued; ``overrides`` may raise ``--model.num_rounds``.

The run: build the federation from the config exactly as ``fedfdp.fit`` does (its server half:
:class:`fedfdp.flower.strategy.FlowerFederation`), wait for the nodes, ask each which partition
it holds (``query``), then ``Trainer.fit`` as in a simulation, with every client's round and every
evaluation done on its node. Before every message round the server asks the SuperLink again which
nodes are connected: a SuperNode restarted for the same partition (new node id, same state file
and ledger) is taken back at the next round. Clients left out of rounds are listed in
``summary.json`` (``missing_clients``; status ``completed_with_missing_clients``) and ``report.md``,
and one log line per such client at the end says which rounds. A configuration problem on the
server or on a node stops the run with one ``error:`` line in the log, and the run is marked failed.
"""

from __future__ import annotations

import json
import logging
import shlex
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp

from fedfdp.rundir import DEPLOYMENT_RECORD_NAME

logger = logging.getLogger("fedfdp.flower.server_app")

__all__ = ["ServerSettings", "app", "run_server"]

app = ServerApp()

#: Written in the run directory at the end: per client its node, settings, ε (its own and the server's
#: view), refused rounds and whether it dropped out.
DEPLOYMENT_RECORD = DEPLOYMENT_RECORD_NAME

_KEYS = ("config", "overrides", "run-dir", "round-timeout", "straggler-timeout", "node-wait", "ckpt-path")


@dataclass(frozen=True)
class ServerSettings:
    """The ServerApp's run config (module docstring)."""

    config: Path
    overrides: list[str] = field(default_factory=list)
    run_dir: str | None = None
    round_timeout: float = 600.0
    straggler_timeout: float | None = None
    node_wait: float = 120.0
    ckpt_path: str | None = None

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any]) -> ServerSettings:
        """Parse and check the run config (one-line ``ConfigError`` on a bad value)."""
        from fedfdp.cli.errors import config_file_problem
        from fedfdp.errors import require

        unknown = sorted(set(run_config) - set(_KEYS))
        require(not unknown, f"run-config has unknown keys {unknown}; accepted: {list(_KEYS)}")
        require(bool(run_config.get("config")), "run-config must set config (the fedfdp YAML, e.g. "
                                                "config='configs/fmnist.yaml')")
        path = resolve_config(str(run_config["config"]))
        problem = config_file_problem(str(path))
        require(problem is None, f"run-config config: {problem}")
        timeout, wait = run_config.get("round-timeout", 600.0), run_config.get("node-wait", 120.0)
        straggler = run_config.get("straggler-timeout", 0.0)
        for name, value in (("round-timeout", timeout), ("node-wait", wait), ("straggler-timeout", straggler)):
            least = 0 if name == "straggler-timeout" else 1e-9
            require(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= least,
                    f"run-config {name} must be a number of seconds {'>= 0' if least == 0 else '> 0'}, got {value!r}")
        run_dir = str(run_config.get("run-dir") or "") or None
        ckpt = str(run_config.get("ckpt-path") or "") or None
        require(ckpt is None or run_dir is not None,
                "run-config ckpt-path continues the run in run-dir: set run-dir to the run to resume")
        return cls(config=path, overrides=shlex.split(str(run_config.get("overrides", ""))),
                   run_dir=run_dir, round_timeout=float(timeout),
                   straggler_timeout=float(straggler) or None, node_wait=float(wait), ckpt_path=ckpt)


def resolve_config(path: str) -> Path:
    """``path`` as given when it exists from the working directory, else relative to the fedfdp checkout."""
    from datamodules.paths import CHECKOUT

    given = Path(path).expanduser()
    if given.is_absolute() or given.exists() or CHECKOUT is None:
        return given
    return CHECKOUT / given if (CHECKOUT / given).exists() else given


def _wait_for_nodes(grid: Grid, count: int, wait: float) -> list[int]:
    """The connected nodes' ids, once at least ``count`` are connected (at most ``wait`` seconds)."""
    from fedfdp.errors import ConfigError

    deadline = time.monotonic() + wait
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= count:
            return nodes
        if time.monotonic() > deadline:
            raise ConfigError(f"{len(nodes)} SuperNodes connected within node-wait={wait:g} s, the run needs one per "
                              f"client ({count}: data.num_clients)")
        time.sleep(0.5)


def _query_nodes(grid: Grid, node_ids: list[int], config: str, num_clients: int,
                 timeout: float) -> tuple[dict[int, int], dict[int, Any]]:
    """Ask every node which client it holds; ``(partition → node id, partition → description)``.

    Two nodes that both answer for one partition stop the run (one ``error:`` line); so do a node
    that cannot take part and a partition no node answers for.
    """
    from fedfdp.errors import ConfigError
    from fedfdp.flower.roster import describe_nodes

    nodes: dict[int, int] = {}
    described: dict[int, Any] = {}
    for node, info in describe_nodes(grid, node_ids, config, timeout=timeout).items():
        if isinstance(info, str):
            raise ConfigError(f"SuperNode {node} cannot take part: {info}")
        if info.partition in nodes:
            raise ConfigError(f"SuperNodes {nodes[info.partition]} and {node} both hold partition-id={info.partition}; "
                              f"give each node its own partition-id")
        nodes[info.partition], described[info.partition] = node, info
        logger.info("client %d on SuperNode %d: %d training samples, target epsilon %s, %s RNG, epsilon spent "
                    "before this run %.4f", info.partition, node, info.train_size, info.target_epsilon,
                    "secure" if info.secure_rng else "seeded", info.epsilon)
    missing = sorted(set(range(num_clients)) - set(nodes))
    if missing:
        raise ConfigError(f"no SuperNode answered for partitions {missing} within round-timeout={timeout:g} s "
                          f"(data.num_clients={num_clients})")
    return nodes, described


def run_server(grid: Grid, settings: ServerSettings) -> Path:
    """Run the configured federation over ``grid``'s nodes; the run directory."""
    from fedfdp.cli.parser import build_cli
    from fedfdp.cli.rundir_guard import RunDirGuard
    from fedfdp.flower.strategy import FlowerFederation, RemoteClients

    args = ["--config", str(settings.config), *settings.overrides]
    if settings.run_dir is not None:
        args += ["--run_dir", settings.run_dir]
    if settings.ckpt_path is not None:
        args += ["--ckpt_path", settings.ckpt_path]
    cli = build_cli(args, model_class=FlowerFederation)
    try:
        resolved = cli.config.clone()
        for key in ("config", "run_dir", "ckpt_path"):
            resolved[key] = None
        config_text = cli.parser.dump(resolved, skip_none=False)  # what every node builds its client from
        num_clients = cli.datamodule.num_clients
        node_ids = _wait_for_nodes(grid, num_clients, settings.node_wait)
        nodes, described = _query_nodes(grid, node_ids, config_text, num_clients, settings.round_timeout)
        federation: FlowerFederation = cli.model
        federation.connect(grid, nodes, config_text, settings.round_timeout, settings.straggler_timeout, described)
        datamodule = RemoteClients(cli.datamodule, described)
    except BaseException:
        for cb in cli.trainer.callbacks:  # nothing was trained: free the run directory
            if isinstance(cb, RunDirGuard) and cb.lock is not None:
                cb.lock.release()
        raise
    cli.trainer.fit(federation, datamodule=datamodule, ckpt_path=cli.config.get("ckpt_path"))
    record = Path(cli.run_dir) / DEPLOYMENT_RECORD
    record.write_text(json.dumps(federation.deployment_record(described), indent=2))
    for line in federation.left_out_lines():
        logger.warning("%s", line)
    for cid in sorted(federation.dropped):
        logger.warning("client %d has no live SuperNode at the end of the run (it stopped answering in %s)", cid,
                       federation.roster.lost_in.get(cid, "an earlier round"))
    logger.info("run finished: %s (%d refusals)", cli.run_dir, len(federation.refusals))
    return Path(cli.run_dir)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """The ServerApp's entry point: :func:`run_server` with the run config; errors as one line."""
    from fedfdp.errors import FedFDPError
    from fedfdp.cli.errors import fedfdp_cause, one_line
    from fedfdp.cli.log_setup import configure_logging

    configure_logging()
    # the ServerApp process has its own command line; the run's arguments are the run config's
    warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter")
    try:
        run_server(grid, ServerSettings.from_run_config(dict(context.run_config)))
    except Exception as err:
        cause = fedfdp_cause(err)
        if cause is not None:
            logger.error("error: %s", one_line(str(cause)))
            raise FedFDPError(one_line(str(cause))) from None
        raise
