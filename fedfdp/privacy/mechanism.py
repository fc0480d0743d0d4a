"""Receipts of the one private mechanism: an upload charges only what the mechanism did.

Every differentially private release a client makes is one call of a release function of
:mod:`fedfdp.privacy.release` (the Gaussian mechanism on a clipped sum: the model step of
:meth:`fedfdp.client.ClientModule.apply_private_sum`, FedFDP's loss release, the adaptive-clipping
count, a label histogram, FinP's curvature) or of the exponential mechanism
(:func:`exponential_selection`). Each call records a :class:`MechanismCall` ``(kind, σ, q,
sample)`` in the client's open :class:`MechanismTrace` and registers what it released; nobody
else writes to the trace. The federation opens a trace around each client's local update and its
release (:func:`tracing`), and before the upload leaves the client (before the ledger is written)
it checks with :func:`verify_upload` that

1. the DP events the upload charges are exactly the mechanism's calls, kind by kind, with the same
   σ and q: an event ``DPEvent(σ, q, steps=k)`` of kind ``m`` stands for ``k`` calls. Calls of one
   kind on the same Poisson sample are one joint Gaussian mechanism with
   ``σ = (Σ_k σ_k^{-2})^{-1/2}`` (the noise split of Andrew et al. 2021, Thm. 1: a model step and
   its clip count charged as one SGM(q, σ));
2. every field of the upload that is declared private by a kind of release
   (:meth:`fedfdp.algorithms.Algorithm.upload_privacy`) came out of the mechanism: ``params`` is a
   model state the mechanism stamped (the client's trainable parameters right after a private
   step, read by :meth:`~fedfdp.client.ClientModule.get_flat_params` with no change in between,
   tracked by torch's in-place version counters), ``reported_loss`` a value the loss release
   returned, and an ``extras`` field (which an algorithm may compute from several releases, e.g.
   a sum of noisy counts) has a call of its kind in the trace.

So a subclass that takes a plain step, adds an unnoised term after the private step, charges a
release it did not make or makes one it does not charge is refused before anything is written.
Outside a trace (library use: a test calling ``training_step`` directly) the release functions
record nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fedfdp.privacy.accounting import DPEvent
from fedfdp.types import CLIENT_RELEASE

if TYPE_CHECKING:
    from fedfdp.types import ClientUpdate

__all__ = ["MechanismCall", "MechanismTrace", "checked_one_off_release", "current_trace", "joint_calls",
           "record_call", "stamp_model", "tracing", "verify_one_off_release", "verify_upload"]

_REL_TOL = 1e-9
"""Relative tolerance when a charged σ is compared with the mechanism's: a release configured by its
std (a noisy count) records σ = std / sensitivity, whose last bit may differ from the charged σ; a
model release records σ as it travels (:func:`fedfdp.privacy.release.gaussian_sum_release`)."""


@dataclass(frozen=True)
class MechanismCall:
    """One call of the mechanism: its kind, noise multiplier σ, Poisson rate q and sample.

    ``sample`` identifies the Poisson sample the call released a statistic of (the step's
    :class:`~fedfdp.types.LocalBatch`, or a fresh object for a release on its own sample);
    calls of one kind on one sample are one joint mechanism (:func:`joint_calls`).
    """

    kind: str
    noise_multiplier: float
    sample_rate: float | None
    sample: object = field(compare=False, repr=False)


@dataclass
class MechanismTrace:
    """What the mechanism did during one client's local update and release.

    Attributes:
        client_id: the client.
        calls: every :class:`MechanismCall`, in order.
        released: the scalar outputs of releases whose value is uploaded as it is (the loss).
        released_tensors: the tensor outputs of releases handed over as they are (a histogram).
        model_states: flat parameter vectors read at a stamped state (after a private step).
        start_states: the model the federation loaded to start the update (:meth:`note_start`).
        public_states: the algorithm's public server state (``Algorithm.public_server_state``), read
            only when a model is loaded that is none of the states above (e.g. a cluster model).

    The trace follows the chain of model states a private step may start from: a state is *clean*
    when it is the start model, a public server state, a state read right after a private step
    that started from a clean state, or a reload of any of these. A private step from a state that
    is not clean (after a plain step, an edit of the parameters, a load of anything else) releases
    a model that is not stamped, so an upload of it is refused: the guarantee of the uploaded model
    rests on every step between the broadcast and the upload being private.
    """

    client_id: int
    calls: list[MechanismCall] = field(default_factory=list)
    released: list[float] = field(default_factory=list)
    released_tensors: list[Tensor] = field(default_factory=list)
    model_states: list[Tensor] = field(default_factory=list)
    start_states: list[Tensor] = field(default_factory=list)
    public_states: Callable[[], Any] | None = None
    _stamp: tuple[tuple[int, int], ...] | None = None
    _samples: list[object] = field(default_factory=list)  # keeps the samples alive: their ids stay unique

    def note_model_read(self, params: Sequence[Tensor], flat: Tensor) -> None:
        """``flat`` was read from ``params``: a released model state if nothing changed them since the
        last private step."""
        if self._stamp is not None and self._stamp == _versions(params):
            self.model_states.append(flat)

    def note_start(self, params: Sequence[Tensor], flat: Tensor) -> None:
        """The federation loaded ``flat`` (the start of the local update) into ``params``: a clean state."""
        self.start_states.append(flat)
        self._stamp = _versions(params)

    def note_load(self, params: Sequence[Tensor], flat: Tensor) -> None:
        """``flat`` was loaded into ``params``: clean if it is a clean state, else the chain is broken."""
        self._stamp = _versions(params) if self._known(flat) else None

    def is_clean(self, params: Sequence[Tensor]) -> bool:
        """Whether ``params`` hold a clean state (nothing changed them since one was loaded or released)."""
        return self._stamp is not None and self._stamp == _versions(params)

    def _known(self, flat: Tensor) -> bool:
        if any(_equal(flat, state) for state in (*self.start_states, *self.model_states)):
            return True
        return self.public_states is not None and any(_equal(flat, t) for t in _tensors(self.public_states()))

    def released_model(self, params: Tensor) -> bool:
        """Whether ``params`` is a model state the mechanism stamped (the same tensor, or equal to one)."""
        if any(params is state for state in self.model_states):
            return True
        return any(state.shape == params.shape and state.device == params.device and torch.equal(state, params)
                   for state in self.model_states)


_TRACE: ContextVar[MechanismTrace | None] = ContextVar("fedfdp_mechanism_trace", default=None)


def current_trace() -> MechanismTrace | None:
    """The trace open in this context (None outside a client's local update)."""
    return _TRACE.get()


@contextmanager
def tracing(client_id: int, public_states: Callable[[], Any] | None = None) -> Iterator[MechanismTrace]:
    """Open a fresh trace for ``client_id``'s local update and release (``public_states``: the
    algorithm's public server state, :attr:`MechanismTrace.public_states`)."""
    trace = MechanismTrace(client_id, public_states=public_states)
    token = _TRACE.set(trace)
    try:
        yield trace
    finally:
        _TRACE.reset(token)


@contextmanager
def resumed(trace: MechanismTrace) -> Iterator[MechanismTrace]:
    """Reopen ``trace``: a client's local update that runs in several pieces (the steps of a
    lockstep round, :mod:`fedfdp.stacked`) collects one trace, as one piece would."""
    token = _TRACE.set(trace)
    try:
        yield trace
    finally:
        _TRACE.reset(token)


def record_call(kind: str, noise_multiplier: float, sample_rate: float | None, sample: object,
                output: float | Tensor | None = None) -> None:
    """Record one call of the mechanism in the open trace (the release functions' business alone).

    ``output``: the released value when it is handed over as it is (a loss, a histogram).
    """
    trace = _TRACE.get()
    if trace is None:
        return
    trace.calls.append(MechanismCall(kind, float(noise_multiplier), sample_rate, sample))
    trace._samples.append(sample)
    if isinstance(output, Tensor):
        trace.released_tensors.append(output)
    elif output is not None:
        trace.released.append(float(output))


def stamp_model(params: Sequence[Tensor], clean: bool = True) -> None:
    """The mechanism's private step has just updated ``params``: their state is a released model when
    the step started from a clean state (``clean``), else not (:class:`MechanismTrace`)."""
    trace = _TRACE.get()
    if trace is not None:
        trace._stamp = _versions(params) if clean else None


def _equal(a: Tensor, b: Tensor) -> bool:
    return a is b or (a.shape == b.shape and torch.equal(a.detach().to(b.device), b.detach()))


def _tensors(value: Any) -> Iterator[Tensor]:
    """The tensors in a public server state (dicts, lists and tuples of tensors; a stacked tensor's rows)."""
    if isinstance(value, Tensor):
        yield value
        if value.dim() == 2:
            yield from value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _versions(params: Sequence[Tensor]) -> tuple[tuple[int, int], ...]:
    # torch's in-place version counter (``Tensor._version``, the counter autograd uses to detect
    # modified saved tensors) changes with every in-place write to a parameter (optimizer steps,
    # ``copy_``, ``add_`` under no_grad): a state read with equal counters is the stamped state
    return tuple((id(p), p._version) for p in params)


def joint_calls(calls: Sequence[MechanismCall]) -> list[tuple[str, float, float | None]]:
    """``(kind, σ, q)`` per joint mechanism: calls of one kind on one sample joined with
    ``σ = (Σ σ_k^{-2})^{-1/2}`` (σ = 0 anywhere gives 0: no noise)."""
    groups: dict[tuple[str, int], list[MechanismCall]] = {}
    for call in calls:
        groups.setdefault((call.kind, id(call.sample)), []).append(call)
    joint = []
    for (kind, _), members in groups.items():
        sigmas = [c.noise_multiplier for c in members]
        sigma = 0.0 if min(sigmas) <= 0 else sum(s ** -2 for s in sigmas) ** -0.5
        rates = {c.sample_rate for c in members}
        joint.append((kind, sigma, members[0].sample_rate if len(rates) == 1 else None))
    return joint


def _charged(events: Sequence[tuple[str, DPEvent]]) -> list[tuple[str, float, float | None]]:
    return [(kind, float(e.noise_multiplier), float(e.sample_rate)) for kind, e in events for _ in range(e.steps)]


def _same(a: tuple[str, float, float | None], b: tuple[str, float, float | None]) -> bool:
    return (a[0] == b[0] and a[2] is not None and b[2] is not None and math.isclose(a[2], b[2], rel_tol=_REL_TOL)
            and math.isclose(a[1], b[1], rel_tol=_REL_TOL))


def _describe(entries: list[tuple[str, float, float | None]]) -> str:
    first = entries[0]
    q = "unset" if first[2] is None else f"{first[2]:g}"
    more = f" (and {len(entries) - 1} more)" if len(entries) > 1 else ""
    return f"{first[0]!r} at sigma={first[1]:g}, q={q}{more}"


def unmatched(events: Sequence[tuple[str, DPEvent]], trace: MechanismTrace
              ) -> tuple[list[tuple[str, float, float | None]], list[tuple[str, float, float | None]]]:
    """``(charged but not made, made but not charged)``: the difference of the two multisets."""
    made = joint_calls(trace.calls)
    missing = []
    for entry in _charged(events):
        match = next((k for k, m in enumerate(made) if _same(entry, m)), None)
        if match is None:
            missing.append(entry)
        else:
            made.pop(match)
    return missing, made


def verify_upload(update: ClientUpdate, trace: MechanismTrace, declared: dict[str, str | None],
                  post_processing: str) -> list[str]:
    """Why ``update`` may not leave its client (empty: its charges and fields are the mechanism's).

    ``declared``: the run's ``{field: kind}`` upload declarations (:mod:`fedfdp.privacy.uploads`);
    ``post_processing``: the kind that marks a field computed from releases (checked by kind only
    where it names none).
    """
    from fedfdp.privacy.uploads import describe, upload_fields

    problems = []
    missing, extra = unmatched(update.dp_events, trace)
    if missing:
        problems.append(f"charges {len(missing)} DP event(s) {_describe(missing)} that the private mechanism did not "
                        f"make in its local update (a step outside ClientModule's private step, or a release "
                        f"without fedfdp.privacy.release)")
    if extra:
        problems.append(f"made {len(extra)} private release(s) {_describe(extra)} that the upload does not charge")
    kinds = {call.kind for call in trace.calls}
    for name in upload_fields(update):
        kind = declared.get(name)
        if kind is None or kind in (post_processing, CLIENT_RELEASE):
            continue  # not claimed private (refused elsewhere), post-processing of charged releases, or
            # released only through the client-level mechanism's noisy sum on the server side
        if name == "params" and not trace.released_model(update.params):
            problems.append(f"uploads a {describe(name)} that is not the model state after its last private step "
                            f"(changed after the mechanism, trained without it, or trained from a model that was "
                            f"neither the one it was handed nor a released one)")
        elif name == "reported_loss" and update.reported_loss not in trace.released:
            problems.append(f"uploads a {describe(name)} that the loss release did not return")
        elif name.startswith("extras.") and kind not in kinds:
            problems.append(f"uploads {describe(name)}, declared a {kind!r} release, without a {kind!r} call of the "
                            f"mechanism")
    return problems


def verify_one_off_release(events: Sequence[tuple[str, DPEvent]], trace: MechanismTrace,
                           release: dict[str, Tensor]) -> list[str]:
    """Why a one-off release (``Algorithm.fit_start_release``) may not be handed over: its charged
    ``events`` are not the mechanism's calls, or a value of ``release`` is not a mechanism output."""
    problems = []
    missing, extra = unmatched(events, trace)
    if missing:
        problems.append(f"charges {len(missing)} DP event(s) {_describe(missing)} that the private mechanism did not "
                        f"make")
    if extra:
        problems.append(f"made {len(extra)} private release(s) {_describe(extra)} that it does not charge")
    for name, value in release.items():
        if not any(value is out or (out.shape == value.shape and torch.equal(out.to(value.device), value))
                   for out in trace.released_tensors):
            problems.append(f"hands over {name!r}, which no release of the mechanism returned")
    return problems


def checked_one_off_release(algorithm: Any, federation: Any, client_id: int,
                            events: Sequence[tuple[str, DPEvent]]) -> dict[str, Tensor]:
    """``algorithm.fit_start_release(federation, client_id)`` computed inside a trace and checked
    against the ``events`` already charged for it (in a simulation and on a deployed node alike).

    Raises:
        PrivacyError: the release is not what the charged events cover; it is not handed over.
    """
    from fedfdp.errors import PrivacyError

    with tracing(client_id) as trace:
        release = algorithm.fit_start_release(federation, client_id)
    problems = verify_one_off_release(events, trace, release)
    if problems:
        raise PrivacyError(f"client {client_id}'s one-off release (fit_start_release) {problems[0]}; it was not "
                           f"handed over")
    return release
