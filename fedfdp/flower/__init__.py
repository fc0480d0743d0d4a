"""fedfdp on Flower: the simulation's algorithms with every client on its own SuperNode.

* :mod:`fedfdp.flower.server_app` — the ServerApp (``fedfdp.flower.server_app:app``);
* :mod:`fedfdp.flower.client_app` — the ClientApp (``fedfdp.flower.client_app:app``);
* :mod:`fedfdp.flower.strategy` — :class:`~fedfdp.flower.strategy.FlowerFederation`, the
  simulation's federation whose clients' rounds and evaluations run on their nodes;
* :mod:`fedfdp.flower.roster` — which node serves each client, kept up to date as nodes are lost
  and restarted (and the message exchange with the SuperLink);
* :mod:`fedfdp.flower.remote` — the server's stand-in for the clients' data (sizes only);
* :mod:`fedfdp.flower.node` — one client on its node, built from the run's config;
* :mod:`fedfdp.flower.node_ledger` — the client's own durable privacy ledger and refusal;
* :mod:`fedfdp.flower.protocol` — the messages between them.

Needs the ``flower`` extra (``pip install -e ".[flower]"``); the Flower app's metadata is
``examples/flower_app/pyproject.toml``. Nothing here is imported by the rest of fedfdp.
"""
