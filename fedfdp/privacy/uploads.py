"""What leaves a client, and whether each part of it is private: fail-closed DP claims.

An upload (:class:`~fedfdp.types.ClientUpdate`) carries fields: ``params`` (the local model,
always), ``reported_loss`` (when a loss is reported) and ``extras.<key>`` (algorithm payloads
such as control variates or cluster choices). The algorithm and the callbacks declare how each
field they put into an upload is private (``Algorithm.upload_privacy`` /
``FederationCallback.upload_privacy``):

* a DP event kind (``"model"``, ``"loss"``, ...): the field is the output of a Gaussian release
  of that kind, which a :class:`~fedfdp.privacy.validation.DPRelease` declares (σ, clip bound)
  and every upload charges as a DP event of that kind;
* :data:`POST_PROCESSING`: the field is computed only from charged releases and public values
  (e.g. SCAFFOLD's control-variate change from the noisy model, an adaptive bound from released
  counts); post-processing costs no ε (Dwork & Roth 2014, Prop. 2.1);
* :data:`~fedfdp.types.CLIENT_RELEASE`: the field (the model) reaches the server's half only through
  the client-level mechanism's noisy sum of clipped updates, charged once a round to the population
  (:class:`fedfdp.privacy.ClientLevelDP`), not with each upload;
* ``None``: the field leaves the client without a guarantee.

A run's claim of (ε, δ)-DP holds only when every declared field is private
(:func:`unprotected_declarations`, checked at start) and every upload actually released carries
only declared fields, each with an event of its kind (:func:`unprotected_fields`, checked
before each upload leaves). Anything not declared counts as not private: an algorithm that
declares nothing is not DP.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from fedfdp.privacy.validation import DPRelease
from fedfdp.types import CLIENT_RELEASE, ClientUpdate


class _Declaring(Protocol):
    """What :func:`declared_upload_privacy` reads of a federation (:class:`fedfdp.interfaces.FederationView`)."""

    algorithm: Any

    def federation_callbacks(self) -> list[Any]: ...

__all__ = ["POST_PROCESSING", "declared_upload_privacy", "unprotected_declarations", "unprotected_fields",
           "upload_fields"]

POST_PROCESSING = "post-processing"
"""An upload field computed only from charged releases and public values (no ε of its own)."""

_FIELD_NAMES = {"params": "model update", "reported_loss": "reported loss"}


def describe(field: str) -> str:
    """A field's name as an error message says it (``"model update"``, ``"extras['cluster']"``)."""
    if field.startswith("extras."):
        return f"extras[{field[len('extras.'):]!r}]"
    return _FIELD_NAMES.get(field, field)


def upload_fields(update: ClientUpdate) -> list[str]:
    """The fields an upload actually carries: ``params``, ``reported_loss`` if set, ``extras.<key>``."""
    fields = ["params"]
    if update.reported_loss is not None:
        fields.append("reported_loss")
    fields.extend(f"extras.{key}" for key in sorted(update.extras))
    return fields


def declared_upload_privacy(federation: _Declaring) -> dict[str, str | None]:
    """Every field's declared privacy: the algorithm's, then the callbacks' (a callback that fills a
    field, e.g. a loss reporter, declares it). A field declared twice keeps the weaker claim."""
    declared: dict[str, str | None] = dict(federation.algorithm.upload_privacy())
    for cb in federation.federation_callbacks():
        for field, kind in cb.upload_privacy(federation).items():
            if field in declared and declared[field] is None:
                continue
            declared[field] = kind
    return declared


def unprotected_declarations(declared: dict[str, str | None], releases: Iterable[DPRelease]) -> list[str]:
    """Declared fields without a guarantee: declared ``None``, or private by a kind of release that
    no component declares (its σ and bound are then unchecked). Messages, one per field."""
    kinds = {r.kind for r in releases}
    problems = []
    for field, kind in declared.items():
        if kind is None:
            problems.append(f"the {describe(field)} leaves each client without clipping and noise")
        elif kind != POST_PROCESSING and kind not in kinds:
            problems.append(f"the {describe(field)} is declared private by a {kind!r} release that no component "
                            f"declares (DPRelease.kind)")
    return problems


def unprotected_fields(update: ClientUpdate, declared: dict[str, str | None]) -> list[str]:
    """Fields of an actual upload that would leave without a guarantee: undeclared, declared not
    private, or declared private by a kind of release the upload does not charge."""
    charged = {kind for kind, _ in update.dp_events}
    problems = []
    for field in upload_fields(update):
        kind = declared.get(field)
        if field not in declared or kind is None:
            problems.append(describe(field) + (" (declared by no component)" if field not in declared else ""))
        elif kind not in (POST_PROCESSING, CLIENT_RELEASE) and kind not in charged:
            problems.append(f"{describe(field)} (no {kind!r} DP event charged for it)")
    return problems
