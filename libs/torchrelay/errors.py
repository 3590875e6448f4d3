"""The errors of the bus and of the handlers it runs (``torchrelay.bus`` re-exports them).

A bus operation raises :class:`BusError` (or a subclass naming what went wrong); a handler
raises :class:`TransientError` to be retried, :class:`PermanentError` to dead-letter its
message, and :class:`RequestInvalid` (:class:`NotFound`, :class:`Conflict`) to answer a
request with an error naming the field.
"""

from __future__ import annotations

from pydantic import ValidationError

from torchrelay.contract import RpcError


class BusError(RuntimeError):
    """A bus operation failed; the message says which and what to do."""


class PermissionRefused(BusError):
    """The NATS server refused an operation: this connection's user may not do it."""


class NoResponder(BusError):
    """A request got no answer within its deadline."""


class RpcFailed(BusError):
    """The service answered a request with an error."""

    def __init__(self, subject: str, error: RpcError) -> None:
        where = f" (field {error.field})" if error.field else ""
        super().__init__(f"{subject}: {error.code}: {error.message}{where}")
        self.subject = subject
        self.error = error


class StaleRevision(BusError):
    """A compare-and-set KV update was refused: someone wrote the key since we read it."""


class TransientError(Exception):
    """Raised by a handler: retry later (the message is nak'd with a delay)."""

    def __init__(self, message: str, delay_s: float = 1.0) -> None:
        super().__init__(message)
        self.delay_s = delay_s


class PermanentError(Exception):
    """Raised by a handler: the message can never succeed; it goes to the dead-letter subject."""


class RequestInvalid(Exception):
    """Raised by an RPC handler: the request is invalid (names the field)."""

    def __init__(self, message: str, field: str | None = None, code: str = "invalid") -> None:
        super().__init__(message)
        self.field = field
        self.code = code


class NotFound(RequestInvalid):
    """Raised by an RPC handler: the object does not exist (or is not visible)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message, field, code="not_found")


class Conflict(RequestInvalid):
    """Raised by an RPC handler: the request conflicts with the current state."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message, field, code="conflict")


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """A one-line message for a validation error and the first offending field."""
    parts = []
    first: str | None = None
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"])
        first = first or (loc or None)
        parts.append(f"{loc or 'body'}: {err['msg']}")
    return "; ".join(parts), first


class LeaseLost(RuntimeError):
    """This replica no longer holds (or cannot be sure it holds) its service's leader lease
    (torchrelay.leadership)."""


__all__ = [
    "BusError",
    "Conflict",
    "LeaseLost",
    "NoResponder",
    "NotFound",
    "PermanentError",
    "PermissionRefused",
    "RequestInvalid",
    "RpcFailed",
    "StaleRevision",
    "TransientError",
    "validation_message",
]
