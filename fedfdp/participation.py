"""Which sampled clients took part in each round and which the final figures cover: a run that says what happened.

A simulation trains every sampled client in every round and evaluates every client. A
deployment may not: a client whose node is lost, fails or does not answer in time, or that
refuses a round on its own privacy budget, is left out of that round, and a client whose node
does not answer an evaluation is missing from the figures pooled over clients. This module keeps
that record and turns it into what ``summary.json`` and ``report.md`` say:

* :class:`Participation`: per round (1-based), the sampled clients that did not upload and why
  (``missing``: no answer, a failure, no live node; ``refused``: the client's own budget);
* :func:`final_status`: ``completed`` or ``budget_spent`` become ``completed_with_missing_clients``
  or ``budget_spent_with_missing_clients`` when any client was left out of any round or the final
  evaluation does not cover every client; no other status changes;
* :func:`coverage_note`, :func:`rounds_phrase` and :func:`compact_rounds`: the same in words (``"rounds 4-8, 10"``).

Only the standard library is imported here (the experiment harnesses read it without torch).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

__all__ = ["MISSING_CLIENTS_STATUSES", "MISSING_SUFFIX", "Participation", "compact_rounds", "coverage_note",
           "final_status", "has_missing_clients", "rounds_phrase"]

#: appended to a finished status when a client was left out of a round or of the final evaluation
MISSING_SUFFIX = "_with_missing_clients"
#: ``summary.json`` statuses of a run that ran every planned round with clients left out (not a complete run)
MISSING_CLIENTS_STATUSES = ("completed" + MISSING_SUFFIX, "budget_spent" + MISSING_SUFFIX)

Reason = Literal["missing", "refused"]


def compact_rounds(rounds: Iterable[int]) -> str:
    """Sorted rounds as ranges: ``[4, 5, 6, 8]`` → ``"4-6, 8"`` (empty: ``"none"``)."""
    ordered = sorted(set(int(r) for r in rounds))
    if not ordered:
        return "none"
    parts: list[str] = []
    start = prev = ordered[0]
    for r in [*ordered[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(parts)


def rounds_phrase(rounds: Iterable[int]) -> str:
    """``"round 6"`` or ``"rounds 4-8, 10"``."""
    rounds = sorted(set(rounds))
    return f"round{'s' if len(rounds) > 1 else ''} {compact_rounds(rounds)}"


class Participation:
    """The rounds each client was left out of (1-based rounds; only rounds where it was sampled).

    Guarantees: :meth:`record` keeps, per round, exactly the sampled clients that did not upload,
    each with one reason; a round recorded again (replayed after a resume) replaces its earlier
    record; :meth:`state_dict`/:meth:`load_state_dict` round-trip the record (checkpoints).
    """

    def __init__(self) -> None:
        self._rounds: dict[int, dict[int, Reason]] = {}

    def record(self, round_number: int, sampled: Sequence[int], uploaded: Iterable[int],
               refused: Iterable[int] = ()) -> dict[int, Reason]:
        """Record round ``round_number`` (1-based): ``sampled`` clients less ``uploaded`` were left out;
        those in ``refused`` refused it, the others were missing. Returns the round's left-out clients."""
        done, said_no = set(uploaded), set(refused)
        left = {int(c): ("refused" if c in said_no else "missing") for c in sampled if c not in done}
        self._rounds.pop(int(round_number), None)
        if left:
            self._rounds[int(round_number)] = dict(sorted(left.items()))  # type: ignore[arg-type]
        return left  # type: ignore[return-value]

    def forget_from(self, round_number: int) -> None:
        """Drop the record of rounds ``>= round_number`` (a resume replays them)."""
        self._rounds = {r: c for r, c in self._rounds.items() if r < round_number}

    def left_out(self, reason: Reason | None = None) -> dict[int, list[int]]:
        """``{client: [rounds]}`` of every client left out of a round (of one ``reason`` if given), sorted."""
        out: dict[int, list[int]] = {}
        for r in sorted(self._rounds):
            for cid, why in self._rounds[r].items():
                if reason is None or why == reason:
                    out.setdefault(cid, []).append(r)
        return dict(sorted(out.items()))

    def __bool__(self) -> bool:
        return bool(self._rounds)

    def state_dict(self) -> dict[str, dict[str, str]]:
        """The record as plain strings (``{round: {client: reason}}``)."""
        return {str(r): {str(c): why for c, why in clients.items()} for r, clients in self._rounds.items()}

    def load_state_dict(self, state: Mapping[str, Mapping[str, str]]) -> None:
        """Restore :meth:`state_dict`."""
        self._rounds = {int(r): {int(c): why for c, why in clients.items()}  # type: ignore[misc]
                        for r, clients in state.items()}


def final_status(status: str, left_out: Mapping[Any, Any], evaluated: Sequence[int] | None, num_clients: int) -> str:
    """``status`` with :data:`MISSING_SUFFIX` when the run finished (``completed``, ``budget_spent``) but
    a client was left out of a round (``left_out`` non-empty) or the final evaluation covers fewer
    than ``num_clients`` clients (``evaluated``; None: no evaluation). Other statuses are returned as given."""
    if status not in ("completed", "budget_spent"):
        return status
    partial = evaluated is not None and len(evaluated) < num_clients
    return status + MISSING_SUFFIX if left_out or partial else status


def has_missing_clients(summary: Mapping[str, Any]) -> bool:
    """Whether a ``summary.json`` says clients were left out of rounds or of the final figures."""
    if summary.get("status") in MISSING_CLIENTS_STATUSES or summary.get("missing_clients"):
        return True
    evaluated, clients = summary.get("evaluated_clients"), summary.get("num_clients")
    return evaluated is not None and clients is not None and len(evaluated) < int(clients)


def coverage_note(summary: Mapping[str, Any]) -> list[str]:
    """Lines (markdown) on the clients a summary's run left out of rounds and of its pooled figures; empty when none."""
    lines: list[str] = []
    missing = summary.get("missing_clients") or {}
    refused = summary.get("refused_clients") or {}
    for cid, rounds in missing.items():
        own = set(refused.get(cid, []))
        gone = [r for r in rounds if r not in own]
        parts = ([f"{rounds_phrase(gone)} (no upload: its node was lost, failed or did not answer)"]
                 if gone else []) + ([f"{rounds_phrase(own)} (refused on its own privacy budget)"] if own else [])
        lines.append(f"- client {cid} left out of {'; '.join(parts)}")
    evaluated, clients = summary.get("evaluated_clients"), summary.get("num_clients")
    if evaluated is not None and clients is not None and len(evaluated) < int(clients):
        absent = sorted(set(range(int(clients))) - set(evaluated))
        lines.append(f"- the final pooled and per-client figures cover clients {', '.join(map(str, evaluated))} "
                     f"({len(evaluated)} of {clients}); client{'s' if len(absent) > 1 else ''} "
                     f"{', '.join(map(str, absent))} did not answer the evaluation")
    return lines
