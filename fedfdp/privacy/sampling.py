"""The sample a private step's amplification rests on is drawn by the mechanism, not declared.

The sampled Gaussian mechanism SGM(q, σ) (Mironov et al. 2019) is charged at rate ``q`` only if
every record of the client's training set was included in the step's batch independently with
probability ``q``. A rate written next to a batch proves nothing: a batch of every record
labelled ``q = 0.2`` would be charged as if amplified (ε 3.49 where the truth, q = 1, gives 7.09).
So the rate the mechanism records with a model release (:mod:`fedfdp.privacy.mechanism`) is the
rate of a sample it drew itself:

* the federation hands each client's training split over with :func:`hand_over` (the only data
  a sample may be drawn from: not a subset, not records repeated, not another client's);
* :func:`poisson_sample` draws a Poisson sample of rate ``q`` from a handed-over split (the next
  draw of the client's generator: the same rows, bit for bit, as ``poisson_mask`` and
  ``select_rows``) and :func:`whole_set` takes all of it (``q = 1``);
* :func:`drawn_rate` tells the mechanism the rate a batch's tensors were drawn at, or None for a
  batch it did not draw (which no charged event matches: the upload is refused).

Batches are recognised by the identity of their tensors, held weakly: a batch changed in place
after the draw is not caught here (the private step reads the tensors it is handed), a batch
built anew is.
"""

from __future__ import annotations

import weakref
from typing import Generic, TypeVar

from torch import Tensor

from fedfdp.seeding import RandomSource, poisson_mask, select_rows
from fedfdp.types import ClientData

__all__ = ["drawn_rate", "hand_over", "poisson_sample", "whole_set"]

V = TypeVar("V")


class _ByIdentity(Generic[V]):
    """``tensor → value`` by object identity, without keeping the tensor alive (tensors compare by value,
    so a weak-key dictionary cannot hold them)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Tensor], V]] = {}

    def put(self, tensor: Tensor, value: V) -> None:
        key = id(tensor)
        self._entries[key] = (weakref.ref(tensor, lambda _, key=key: self._entries.pop(key, None)), value)

    def get(self, tensor: Tensor) -> V | None:
        entry = self._entries.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            return None
        return entry[1]


_HANDED_OVER: _ByIdentity[int] = _ByIdentity()  # a client's split (its x) → the split's size
_DRAWN: _ByIdentity[tuple[Tensor, float]] = _ByIdentity()  # a sample's x → (its y, the rate it was drawn at)


def hand_over(data: ClientData) -> ClientData:
    """``data`` is a client's whole training split as the federation loaded it: samples may be drawn from it."""
    _HANDED_OVER.put(data.x, data.size)
    return data


def _handed_over(data: ClientData) -> bool:
    return _HANDED_OVER.get(data.x) == data.size


def poisson_sample(data: ClientData, sample_rate: float, generator: RandomSource) -> tuple[Tensor, Tensor]:
    """The records of ``data`` each included with probability ``sample_rate`` (the next draw of
    ``generator``), as ``(x, y)``; recorded as drawn at that rate when ``data`` was handed over."""
    x, y = select_rows(poisson_mask(data.size, sample_rate, generator), data.x, data.y)
    if _handed_over(data):
        _DRAWN.put(x, (y, float(sample_rate)))
    return x, y


def whole_set(data: ClientData) -> tuple[Tensor, Tensor]:
    """Every record of ``data`` (a full-batch step, ``q = 1``), recorded as such when ``data`` was handed over."""
    if _handed_over(data):
        _DRAWN.put(data.x, (data.y, 1.0))
    return data.x, data.y


def drawn_rate(x: Tensor, y: Tensor) -> float | None:
    """The rate at which the mechanism drew the batch ``(x, y)`` (None: it did not draw it)."""
    entry = _DRAWN.get(x)
    if entry is None or entry[0] is not y:
        return None
    return entry[1]
