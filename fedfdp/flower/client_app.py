"""The Flower ClientApp: one fedfdp client on its SuperNode (``fedfdp.flower.client_app:app``).

Flower starts one ClientApp process per message, so every message rebuilds the client from the
run's config (:class:`fedfdp.flower.node.NodeClient`) and its state lives on the node: the
client's privacy ledger (``ledger-dir``) and its algorithm state (a file beside the ledger, and a
copy in the node's ``context.state``; :mod:`fedfdp.flower.node_state`). Handlers:

* ``query``: describe the node (partition, data sizes, own target ε and spent ε);
* ``train``: refuse (budget) or run the round's local update and releases, charge them to the
  ledger (fsynced), and only then return the upload;
* ``query.fit_start``: the client's one-off release before training (charged first);
* ``evaluate``: the client's evaluation model on its own test (and train, validation) split.

A configuration or data problem on the node raises, which Flower turns into an error reply that
the server logs with the node's one-line reason.
"""

from __future__ import annotations

import logging
import warnings
from contextlib import closing

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedfdp.flower import protocol

logger = logging.getLogger(__name__)

app = ClientApp()


def _node(message: Message, context: Context):  # type: ignore[no-untyped-def]
    """The client of this node for the run's config (heavy imports happen here, per message)."""
    from fedfdp.cli.log_setup import configure_logging
    from fedfdp.flower.node import NodeClient, NodeSettings

    configure_logging()
    warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter")  # the node's own command line
    settings = NodeSettings.from_node_config(context.node_config)
    return NodeClient(protocol.config_of(message.content), settings, run=str(context.run_id))


@app.query()
def query(message: Message, context: Context) -> Message:
    """Describe this node's client to the server."""
    with closing(_node(message, context)) as node:
        return Message(protocol.encode_node(node.describe()), reply_to=message)


@app.train()
def train(message: Message, context: Context) -> Message:
    """One round of the client: its upload (charged to its ledger first) or its refusal."""
    with closing(_node(message, context)) as node:
        request = protocol.TrainRequest.decode(message.content)
        if request.partition != node.client_id:
            raise ValueError(f"message for partition {request.partition} reached the node of partition "
                             f"{node.client_id}")
        result = node.train(protocol.params_of(message.content), request.round, request.broadcast,
                            request.loss_bounds, request.state_key, protocol.server_state_of(message.content),
                            context.state)
        if isinstance(result, str):
            content = protocol.encode_refusal(node.client_id, result, node.ledger.epsilon())
        else:
            content = protocol.encode_update(result, node.ledger.epsilon())
        return Message(content, reply_to=message)


@app.query(protocol.FIT_START_ACTION)
def fit_start(message: Message, context: Context) -> Message:
    """The client's one-off release before training (e.g. its noisy label histogram), charged first."""
    with closing(_node(message, context)) as node:
        events, release = node.fit_start_release()
        return Message(protocol.encode_fit_start(node.client_id, events, release, node.ledger.epsilon()),
                       reply_to=message)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """The run's model on this client's own splits."""
    with closing(_node(message, context)) as node:
        request = protocol.EvaluateRequest.decode(message.content)
        counts = node.evaluate(protocol.params_of(message.content), request.splits, request.state_key,
                               protocol.server_state_of(message.content), context.state)
        return Message(protocol.encode_evaluation(node.client_id, counts), reply_to=message)
