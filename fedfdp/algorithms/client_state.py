"""Per-client algorithm state: :class:`fedfdp.client_state.ClientStateStore`, named here for algorithms.

The store lives below both the client module and the algorithms (``fedfdp/client_state.py``), so
that imports run one way (the client keeps its local optimizer states in one).
"""

from fedfdp.client_state import ClientStateStore

__all__ = ["ClientStateStore"]
