"""Peer frameworks' sides of the client-level DP FedAvg round benchmark (pfl-research, Flower).

``envs.peer_python(name)`` builds the peer's virtual environment; ``pfl_round.py`` and
``flower_round.py`` time one round of the same task in that framework and write RESULT.json.
"""
