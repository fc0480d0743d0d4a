"""Pure functions that split sample indices across federated clients.

Every function takes an explicit :class:`numpy.random.Generator` (never the global
``np.random`` state) and returns index arrays, so the partition is a deterministic function
of the labels, the arguments and the generator's seed.

Error messages start with the offending argument's name (``"alpha must be > 0, got -1"``)
so callers can prefix their config section (``data.``) when re-raising.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Mapping, Sequence
from numbers import Integral, Real
from typing import Any

import numpy as np

from fedfdp.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["dirichlet_partition", "iid_partition", "population_partition", "partition_fingerprint", "train_test_split_indices",
           "validation_split_indices"]


def _check_int(name: str, value: object, minimum: int) -> int:
    """Return ``value`` as ``int`` if it is an integer ≥ ``minimum``, else raise ConfigError."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    *,
    min_size: int | None = None,
    rng: np.random.Generator | np.random.RandomState,
    max_attempts: int = 1000,
) -> list[np.ndarray]:
    """Split sample indices across clients with Dirichlet label skew (PFLlib / NIID-Bench).

    One attempt: for every class ``k`` (in ascending label order) the indices of class ``k``
    are shuffled, proportions ``p ~ Dir(alpha * 1_N)`` are drawn, the share of every client that
    already holds ``>= len(labels) / N`` samples is set to zero, ``p`` is renormalised and the
    class indices are cut at ``floor(cumsum(p) * n_k)``. Attempts are repeated (continuing the
    same generator) until every client holds at least ``min_size`` samples.

    Args:
        labels: 1-D integer array of sample labels; index ``i`` refers to ``labels[i]``.
        num_clients: Number of clients ``N`` (>= 1).
        alpha: Dirichlet concentration (> 0); small values give strong label skew.
        min_size: Minimum number of samples per client; defaults to the number of distinct
            labels (PFLlib's rule: 10 for MNIST).
        rng: Source of all randomness (a seeded ``RandomState(1)`` reproduces the partition
            of the FedFDP/PFLlib code exactly, e.g. MNIST totals [2336, 6798, ..., 13212]).
        max_attempts: Number of whole draws tried before giving up.

    Returns:
        ``num_clients`` int64 arrays of indices into ``labels``, each sorted ascending; every
        index appears in exactly one array.

    Raises:
        ConfigError: If an argument is out of range, if ``num_clients * min_size`` exceeds the
            number of samples, or if no draw reached ``min_size`` within ``max_attempts`` (or the
            first draws left so many clients short that the remaining ones would almost surely
            fail too: then it fails at once).

    Example:
        >>> parts = dirichlet_partition(np.arange(100) % 4, 3, 1.0, rng=np.random.default_rng(0))
        >>> sum(len(p) for p in parts), min(len(p) for p in parts) >= 4
        (100, True)
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or not (labels.size == 0 or np.issubdtype(labels.dtype, np.integer)):
        raise ConfigError(
            f"labels must be a 1-D integer array, got shape {labels.shape} dtype {labels.dtype}"
        )
    num_clients = _check_int("num_clients", num_clients, 1)
    if isinstance(alpha, bool) or not isinstance(alpha, Real) or not math.isfinite(alpha) or alpha <= 0:
        raise ConfigError(f"alpha must be a finite number > 0, got {alpha!r}")
    max_attempts = _check_int("max_attempts", max_attempts, 1)
    classes, counts = np.unique(labels, return_counts=True)
    default_min = min_size is None
    min_size = len(classes) if min_size is None else _check_int("min_size", min_size, 0)
    n = labels.size
    if num_clients * min_size > n:
        raise ConfigError(
            f"min_size={min_size} is impossible with num_clients={num_clients} and {n} samples: "
            f"num_clients * min_size must be <= {n}"
        )
    # Indices grouped by class (ascending label, then ascending index) without a per-class scan.
    by_class = np.split(np.argsort(labels, kind="stable"), np.cumsum(counts)[:-1])
    cap = n / num_clients
    best, fewest_short = -1, num_clients
    for attempt in range(1, max_attempts + 1):
        parts, sizes = _dirichlet_draw(by_class, num_clients, alpha, cap, rng)
        smallest = int(sizes.min()) if parts is not None else -1
        if parts is not None and smallest >= min_size:
            if attempt > 1:
                logger.debug("dirichlet_partition: min_size=%d reached at attempt %d", min_size, attempt)
            return [np.sort(np.concatenate(p)).astype(np.int64, copy=False) for p in parts]
        best = max(best, smallest)
        fewest_short = min(fewest_short, int((sizes < min_size).sum()) if parts is not None else num_clients)
        if attempt < max_attempts and _hopeless(fewest_short, num_clients, attempt, max_attempts - attempt):
            break  # the remaining draws would fail too: say so now, not minutes later
    if best >= 2:
        accepted = f"min_size between 2 and {best}, a larger alpha or fewer clients"
    else:
        accepted = "a larger alpha, fewer clients or partition: iid"
    raise ConfigError(
        f"min_size={min_size}{' (the default: the number of classes)' if default_min else ''} is impossible in "
        f"practice: {attempt} Dirichlet draws (alpha={alpha}, num_clients={num_clients}, {n} samples, "
        f"{len(classes)} classes) never gave every client >= {min_size} samples (each left >= {fewest_short} "
        f"clients short; best smallest client: {max(best, 0)}); accepted: {accepted}"
    )


#: Stop drawing once the expected number of successful draws left is below this.
_HOPELESS = 1e-6


def _hopeless(fewest_short: int, num_clients: int, attempt: int, remaining: int) -> bool:
    """Whether the remaining Dirichlet draws are (practically) sure to fail as well.

    After at least two draws that each left ``>= fewest_short`` clients below ``min_size``, a
    client falls short with probability about ``f = fewest_short / num_clients``; a draw in which
    none does has probability about ``(1 - f) ** num_clients <= exp(-fewest_short)``. Stopping when
    ``remaining`` draws are expected to succeed fewer than :data:`_HOPELESS` times makes an
    impossible configuration (7,000 FashionMNIST clients with 10 samples each) fail in a fraction
    of a second instead of after every attempt; a draw that can succeed is never cut short.
    """
    if attempt < 2:
        return False
    short = min(fewest_short / num_clients, 1.0)
    per_draw = 0.0 if short >= 1.0 else math.exp(num_clients * math.log1p(-short))
    return remaining * per_draw < _HOPELESS


def _dirichlet_draw(
    by_class: list[np.ndarray],
    num_clients: int,
    alpha: float,
    cap: float,
    rng: np.random.Generator | np.random.RandomState,
) -> tuple[list[list[np.ndarray]] | None, np.ndarray]:
    """Run one PFLlib attempt; return per-client index chunks and sizes (None if degenerate)."""
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    sizes = np.zeros(num_clients, dtype=np.int64)
    concentration = np.full(num_clients, float(alpha))
    for idx_k in by_class:
        idx_k = rng.permutation(idx_k)
        p = rng.dirichlet(concentration)
        p = np.where(sizes < cap, p, 0.0)
        total = p.sum()
        if not np.isfinite(total) or total <= 0:  # all open clients got an underflowed share
            return None, sizes
        cuts = (np.cumsum(p / total) * len(idx_k)).astype(np.int64)[:-1]
        for cid, chunk in enumerate(np.split(idx_k, cuts)):
            parts[cid].append(chunk)
            sizes[cid] += len(chunk)
    return parts, sizes


def iid_partition(n: int, num_clients: int, *, rng: np.random.Generator) -> list[np.ndarray]:
    """Split ``range(n)`` uniformly at random into ``num_clients`` near-equal parts.

    Args:
        n: Number of samples.
        num_clients: Number of clients (>= 1 and <= ``n``).
        rng: Source of randomness.

    Returns:
        ``num_clients`` int64 index arrays, sorted ascending, whose sizes differ by at most one.

    Raises:
        ConfigError: If ``num_clients < 1`` or ``num_clients > n``.
    """
    n = _check_int("n", n, 0)
    num_clients = _check_int("num_clients", num_clients, 1)
    if num_clients > n:
        raise ConfigError(f"num_clients must be <= the number of samples ({n}), got {num_clients}")
    perm = rng.permutation(n).astype(np.int64, copy=False)
    return [np.sort(part) for part in np.array_split(perm, num_clients)]


def population_partition(
    labels: np.ndarray, num_clients: int, alpha: float, *, size_sigma: float, min_size: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """A population of many small clients: log-normal sizes and Dirichlet label skew.

    Client ``k`` gets ``n_k = m + M_k`` records, ``M ~ Multinomial(n − N m, s / Σ s)`` with
    ``s_k ~ LogNormal(0, size_sigma)`` (heavy-tailed sizes, as FEMNIST's writers: Caldas et al. 2018),
    and a label mix ``p_k ~ Dir(alpha · 1)``: its ``n_k`` records are drawn class by class from
    ``Multinomial(n_k, p_k)``, each class's draw capped at what is left of that class, the rest
    filled from the classes with records left (in proportion to what is left). Every record goes
    to exactly one client.

    Args:
        labels: ``(n,)`` integer labels.
        num_clients: N (>= 1, N · min_size <= n).
        alpha: Dirichlet concentration of the label mix (> 0; small: few classes per client).
        size_sigma: σ of the log-normal size weights (>= 0; 0: equal sizes up to rounding).
        min_size: records every client gets at least (>= 2: a train and a test record).
        rng: Source of randomness.

    Returns:
        ``num_clients`` int64 index arrays, sorted ascending, disjoint, covering ``range(n)``.

    Raises:
        ConfigError: an argument out of range, or too few records for ``num_clients · min_size``.
    """
    labels = np.asarray(labels).reshape(-1)
    n = len(labels)
    num_clients = _check_int("num_clients", num_clients, 1)
    min_size = _check_int("min_size", min_size, 2)
    if not (isinstance(alpha, Real) and math.isfinite(alpha) and alpha > 0):
        raise ConfigError(f"alpha must be a finite number > 0, got {alpha!r}")
    if not (isinstance(size_sigma, Real) and math.isfinite(size_sigma) and size_sigma >= 0):
        raise ConfigError(f"size_sigma must be a finite number >= 0, got {size_sigma!r}")
    if num_clients * min_size > n:
        raise ConfigError(f"num_clients must be <= {n // min_size} (the {n} samples at min_size={min_size} each), "
                          f"got {num_clients}")
    weights = rng.lognormal(0.0, float(size_sigma), num_clients)
    sizes = min_size + rng.multinomial(n - num_clients * min_size, weights / weights.sum())
    classes, codes = np.unique(labels, return_inverse=True)
    pools = [rng.permutation(np.flatnonzero(codes == c)) for c in range(len(classes))]
    left = np.array([len(p) for p in pools], dtype=np.int64)
    taken = np.zeros(len(classes), dtype=np.int64)
    mixes = rng.dirichlet(np.full(len(classes), float(alpha)), num_clients)
    parts = []
    for size, mix in zip(sizes.tolist(), mixes):
        counts = np.minimum(rng.multinomial(size, mix), left)
        short = size - int(counts.sum())
        while short > 0:  # fill from the classes with records left, in proportion to what is left
            room = left - counts
            extra = np.minimum(rng.multinomial(short, room / room.sum()), room)
            counts += extra
            short -= int(extra.sum())
        parts.append(np.sort(np.concatenate([pools[c][taken[c]:taken[c] + k] for c, k in enumerate(counts.tolist())
                                             if k > 0]).astype(np.int64)))
        taken += counts
        left -= counts
    return parts


def train_test_split_indices(
    indices: np.ndarray, train_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle one client's indices and split them into a train and a test part.

    As in PFLlib (scikit-learn ``train_test_split``), the train part receives
    ``floor(train_fraction * n)`` samples; the result is clamped so both parts are non-empty.

    Args:
        indices: 1-D array of the client's sample indices.
        train_fraction: Fraction of samples for training, in (0, 1).
        rng: Source of randomness for the shuffle.

    Returns:
        ``(train, test)`` int64 index arrays, each sorted ascending, disjoint, covering ``indices``.

    Raises:
        ConfigError: If ``train_fraction`` is outside (0, 1) or the client holds < 2 samples.
    """
    if isinstance(train_fraction, bool) or not isinstance(train_fraction, Real) or not 0 < train_fraction < 1:
        raise ConfigError(f"train_fraction must be in (0, 1), got {train_fraction!r}")
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    n = len(indices)
    if n < 2:
        raise ConfigError(
            f"min_size must be >= 2 so every client has a train and a test sample, got a client with {n}"
        )
    n_train = min(max(int(math.floor(train_fraction * n)), 1), n - 1)
    shuffled = rng.permutation(indices)
    return np.sort(shuffled[:n_train]), np.sort(shuffled[n_train:])


def validation_split_indices(
    train: np.ndarray, val_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Hold ``val_fraction`` of one client's training indices out as its validation split.

    The validation part receives ``floor(val_fraction * n + 1/2)`` samples, clamped so both parts
    are non-empty.

    Args:
        train: 1-D array of the client's training indices.
        val_fraction: Fraction held out, in (0, 1).
        rng: Source of randomness for the shuffle.

    Returns:
        ``(train, val)`` int64 index arrays, each sorted ascending, disjoint, covering ``train``.

    Raises:
        ConfigError: If ``val_fraction`` is outside (0, 1) or the client holds < 2 training samples.
    """
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, Real) or not 0 < val_fraction < 1:
        raise ConfigError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    train = np.asarray(train, dtype=np.int64).reshape(-1)
    n = len(train)
    if n < 2:
        raise ConfigError(f"val_fraction needs >= 2 training samples per client, got a client with {n}")
    n_val = min(max(int(math.floor(val_fraction * n + 0.5)), 1), n - 1)
    shuffled = rng.permutation(train)
    return np.sort(shuffled[n_val:]), np.sort(shuffled[:n_val])


def partition_fingerprint(config: Mapping[str, Any], splits: Sequence[tuple[np.ndarray, ...]]) -> str:
    """Sha256 hex digest identifying a partition: its config plus every client's index arrays.

    Args:
        config: JSON-serialisable settings that produced the partition (hashed with sorted keys).
        splits: Per client ``(train_indices, test_indices)`` (and ``val_indices`` when a validation
            split is held out); lengths are hashed too, so moving an index between neighbouring
            clients changes the digest.

    Returns:
        64 hexadecimal characters.
    """
    digest = hashlib.sha256(json.dumps(dict(config), sort_keys=True).encode())
    for split in splits:
        for arr in split:
            digest.update(np.int64(len(arr)).tobytes())
            digest.update(np.ascontiguousarray(arr, dtype="<i8").tobytes())
    return digest.hexdigest()
