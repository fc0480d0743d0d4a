"""Which SuperNode serves each client of a deployment, kept up to date while the run goes on.

A SuperNode that is restarted for the same partition (the same data, state file and ledger)
comes back under a new Flower node id (or, with node authentication, under its old id after the
SuperLink saw it go offline). The server therefore does not fix the partition → node map at
start: before every message round it asks the SuperLink which nodes are connected, asks each
node it has not heard of which partition it holds (``query``), and keeps :class:`NodeRoster`:

* the node serving a partition keeps it while it is connected and answers;
* a node that was lost or did not answer a message round in time is *failed*: it is not asked
  again while the SuperLink still lists it, and its client is left out of the rounds until a node
  for its partition connects; a failed node that the SuperLink stopped listing is forgotten, so
  that it is asked again if it comes back;
* a newly connected node that describes the same partition as at the run's start (the same
  number of partitions and the same split sizes) takes the partition over at the next message
  round if the partition has no live node, and continues the client from its state and ledger
  files (the server names the state to continue from); one that describes other sizes is not used;
* two live nodes for one partition: the serving one keeps it (one log line names both); the
  other takes over only once the serving one has failed. (At the run's start two nodes that both
  answer for one partition stop the run: :mod:`fedfdp.flower.server_app`.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from fedfdp.flower import protocol
from fedfdp.flower.protocol import NodeDescription

logger = logging.getLogger("fedfdp.flower.strategy")

__all__ = ["NodeRoster", "describe_nodes", "exchange"]


def exchange(grid: Grid, messages: list[Message], *, timeout: float, straggler_timeout: float | None = None,
             poll: float = 0.5) -> list[Message]:
    """Push ``messages`` and pull their replies every ``poll`` seconds until all arrived or time is up.

    Time is up ``timeout`` seconds after the push, or ``straggler_timeout`` seconds after the first
    reply. (Flower's ``Grid.send_and_receive`` polls every 3 s and has no straggler limit.)
    """
    pending = set(grid.push_messages(messages))
    start = time.monotonic()
    deadline = start + timeout
    replies: list[Message] = []
    while pending and time.monotonic() < deadline:
        arrived = list(grid.pull_messages(pending))
        if arrived and not replies and straggler_timeout is not None:
            deadline = min(deadline, time.monotonic() + straggler_timeout)
        replies.extend(arrived)
        pending -= {reply.metadata.reply_to_message_id for reply in arrived}
        if pending:
            time.sleep(poll)
    return replies


def describe_nodes(grid: Grid, node_ids: Iterable[int], config: str, *, timeout: float,
                   straggler_timeout: float | None = None) -> dict[int, NodeDescription | str]:
    """Ask each node which client it holds (``query``): by node id, its description or the reason it
    cannot take part (an error reply). Nodes that do not answer in time are absent."""
    messages = [Message(protocol.query_request(config), dst_node_id=n, message_type=protocol.QUERY) for n in node_ids]
    if not messages:
        return {}
    out: dict[int, NodeDescription | str] = {}
    asked = {m.object_id: m.metadata.dst_node_id for m in messages}
    for reply in exchange(grid, messages, timeout=timeout, straggler_timeout=straggler_timeout):
        node = asked.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
        out[node] = str(reply.error.reason) if reply.has_error() else protocol.decode_node(reply.content)
    return out


def _same_partition(info: NodeDescription, start: NodeDescription) -> str | None:
    """Why ``info`` is not the partition described at the start (None: it is)."""
    now = (info.num_partitions, info.train_size, info.test_size, info.val_size)
    then = (start.num_partitions, start.train_size, start.test_size, start.val_size)
    if now == then:
        return None
    return (f"it reports (partitions, train, test, val sizes) {now}, the run started with {then}: "
            f"not the same data")


class NodeRoster:
    """Partition → serving node, from the nodes at the start and every node that connects later.

    Args:
        nodes: partition → node id at the start of the run.
        described: partition → the description its node gave at the start (what a node that
            takes the partition over must match).
    """

    def __init__(self, nodes: dict[int, int], described: dict[int, NodeDescription]) -> None:
        self.serving: dict[int, int] = dict(nodes)
        self.described = dict(described)
        self.served_by: dict[int, list[int]] = {p: [n] for p, n in nodes.items()}  # every node that served it
        self.claims: dict[int, int | None] = {n: p for p, n in nodes.items()}  # node → partition (None: unusable)
        self.connected: set[int] = set(nodes.values())
        self.failed: set[int] = set()
        self.lost_in: dict[int, str] = {}  # partition → where its serving node stopped answering ("round 4")
        self._duplicates: set[tuple[int, int]] = set()

    def live(self, partition: int) -> int | None:
        """The node serving ``partition`` now: connected, not failed (None: its client has no node)."""
        node = self.serving.get(partition)
        if node is None or node in self.failed or node not in self.connected or self.claims.get(node) != partition:
            return None
        return node

    def without_node(self) -> list[int]:
        """The partitions without a live node, sorted."""
        return sorted(p for p in self.serving if self.live(p) is None)

    def fail(self, node: int, where: str) -> None:
        """``node`` was lost or did not answer in ``where``: not asked again while the SuperLink lists it."""
        self.failed.add(node)
        for p, n in self.serving.items():
            if n == node:
                self.lost_in.setdefault(p, where)

    def refresh(self, connected: set[int], describe: Callable[[list[int]], dict[int, Any]], where: str) -> None:
        """Take the SuperLink's ``connected`` nodes into account before the message round ``where``.

        Failed nodes the SuperLink no longer lists are forgotten (asked again if they come back);
        nodes not heard of are described with ``describe`` (:func:`describe_nodes` bound to the
        grid; a node that does not answer is failed); then each partition without a live node is
        given to the live node that described it last.
        """
        self.connected = set(connected)
        for node in [n for n in self.failed if n not in self.connected]:
            self.failed.discard(node)
            self.claims.pop(node, None)
        new = sorted(n for n in self.connected if n not in self.claims)
        answers = describe(new) if new else {}
        for node in new:
            if node in answers:
                self.claims[node] = self._check(node, answers[node])
            else:
                logger.warning("SuperNode %d connected during the run but did not say which partition it holds in "
                               "time: not used while it stays connected", node)
                self.claims[node] = None
                self.failed.add(node)
        for p in sorted(self.serving):
            node = self.live(p)
            others = [n for n, q in self.claims.items() if q == p and n != node and n in self.connected
                      and n not in self.failed]
            if node is None:
                self.lost_in.setdefault(p, f"{where} (no longer connected)")
                if others:
                    self._take_over(p, others[-1])
                continue
            if p in self.lost_in:  # its own node id came back (node authentication keeps the id)
                logger.warning("client %d: SuperNode %d is connected again for partition-id=%d (it stopped answering "
                               "in %s); the client takes part again from this message round", p, node, p,
                               self.lost_in.pop(p))
            for other in (n for n in others if (p, n) not in self._duplicates):
                self._duplicates.add((p, other))
                logger.warning("SuperNodes %d and %d both hold partition-id=%d: %d serves it while it answers; %d "
                               "is used only if %d is lost", node, other, p, node, other, node)

    def _check(self, node: int, answer: Any) -> int | None:
        """The partition ``node`` may serve (None: it cannot; one log line says why)."""
        if isinstance(answer, str):
            logger.warning("SuperNode %d connected during the run but cannot take part: %s", node, answer)
            return None
        info: NodeDescription = answer
        start = self.described.get(info.partition)
        why = "no such partition in this run" if start is None else _same_partition(info, start)
        if why is not None:
            logger.warning("SuperNode %d connected for partition-id=%d but is not used: %s", node, info.partition, why)
            return None
        return info.partition

    def _take_over(self, partition: int, node: int) -> None:
        before = self.serving[partition]
        self.serving[partition] = node
        if self.served_by.setdefault(partition, [])[-1:] != [node]:
            self.served_by[partition].append(node)
        where = self.lost_in.pop(partition, "an earlier round")
        logger.warning("client %d: SuperNode %d now serves partition-id=%d (SuperNode %d stopped answering in %s); the "
                       "client takes part again from this message round, continuing from its saved state and ledger",
                       partition, node, partition, before, where)
