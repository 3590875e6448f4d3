"""Asking the owning services over NATS request/reply, and turning their answers into HTTP.

The API owns no data: every read and command is a ``tr.rpc.<service>.<verb>`` request.
A service that does not answer is a 503 naming it; its ``not_found``/``invalid``/``conflict``
errors become 404/422/409 problems; a reply of the wrong shape is a 502 naming the service.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from torchrelay.bus import Bus, BusError, NoResponder, RpcFailed, validation_message
from torchrelay.contract import Subjects

B = TypeVar("B", bound=BaseModel)

PROBLEM_BASE = "https://torchrelay.dev/problems/"


class ApiProblem(Exception):
    """An error the API answers with an RFC 9457 problem document."""

    def __init__(
        self,
        status: int,
        title: str,
        detail: str,
        *,
        kind: str,
        field: str | None = None,
        service: str | None = None,
        errors: list[dict[str, Any]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail
        self.kind = kind
        self.field = field
        self.service = service
        self.errors = errors
        self.headers = headers

    def document(self, instance: str | None = None) -> dict[str, Any]:
        """The problem+json body."""
        doc: dict[str, Any] = {
            "type": PROBLEM_BASE + self.kind,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }
        if instance is not None:
            doc["instance"] = instance
        if self.field is not None:
            doc["field"] = self.field
        if self.service is not None:
            doc["service"] = self.service
        if self.errors is not None:
            doc["errors"] = self.errors
        return doc


def not_found(kind: str, ident: str, field: str) -> ApiProblem:
    """The one 404 for an object that is missing *or* belongs to another tenant.

    Both cases must produce byte-identical answers, or a tenant could probe which ids exist.
    """
    return ApiProblem(
        404, "Not Found", f"{kind} {ident!r} does not exist", kind="not-found", field=field
    )


def invalid(field: str, detail: str, status: int = 422) -> ApiProblem:
    """A request refused for one named field."""
    return ApiProblem(status, "Invalid request", f"{field}: {detail}", kind="invalid", field=field)


def unauthorized(detail: str) -> ApiProblem:
    return ApiProblem(
        401,
        "Unauthorized",
        detail,
        kind="unauthorized",
        headers={"WWW-Authenticate": 'Bearer realm="torchrelay"'},
    )


def forbidden(detail: str) -> ApiProblem:
    return ApiProblem(403, "Forbidden", detail, kind="forbidden")


def _from_rpc(service: str, exc: RpcFailed) -> ApiProblem:
    err = exc.error
    message = err.message
    if err.code == "not_found":
        return ApiProblem(404, "Not Found", message, kind="not-found", field=err.field)
    if err.code == "invalid":
        return ApiProblem(
            422, "Invalid request", message, kind="invalid", field=err.field, service=service
        )
    if err.code == "conflict":
        return ApiProblem(
            409, "Conflict", message, kind="conflict", field=err.field, service=service
        )
    if err.code == "forbidden":
        return ApiProblem(403, "Forbidden", message, kind="forbidden", service=service)
    if err.code == "unavailable":
        return ApiProblem(
            503,
            "Service Unavailable",
            f"{service}: {message}",
            kind="service-unavailable",
            service=service,
        )
    return ApiProblem(
        502, "Bad Gateway", f"{service} failed: {message}", kind="bad-gateway", service=service
    )


# Verbs that only read: concurrent identical requests share one round trip (no caching:
# a request that starts after the shared one answered asks again).
READ_VERBS = frozenset(
    {
        "job_list",
        "job_get",
        "job_timeline",
        "incident_list",
        "incident_get",
        "contract_get",
        "contract_list",
        "guarantee",
        "credits_list",
        "export",
        "ledger_verify",
        "cluster_list",
        "node_list",
        "node_get",
        "list",
        "get",
        "depth",
    }
)


class Gateway:
    """The API's client of the services' RPC verbs."""

    def __init__(self, bus: Bus, timeout_s: float = 5.0) -> None:
        self.bus = bus
        self.timeout_s = timeout_s
        self._inflight: dict[str, asyncio.Future[Any]] = {}

    async def call(
        self,
        service: str,
        verb: str,
        payload: dict[str, Any] | None = None,
        *,
        missing: ApiProblem | None = None,
    ) -> Any:
        """Ask ``service`` to ``verb``; ``missing`` replaces the service's not-found answer.

        The result may be shared with concurrent callers of the same read: do not mutate it.
        """
        clean = {k: v for k, v in (payload or {}).items() if v is not None}
        try:
            return await self._request(Subjects.rpc(service, verb), verb, clean)
        except NoResponder as exc:
            raise ApiProblem(
                503,
                "Service Unavailable",
                f"the {service} service is not answering ({exc}); check that it "
                "runs (torchrelay status, or its /readyz)",
                kind="service-unavailable",
                service=service,
                headers={"Retry-After": "5"},
            ) from exc
        except RpcFailed as exc:
            if missing is not None and exc.error.code == "not_found":
                raise missing from exc
            raise _from_rpc(service, exc) from exc
        except BusError as exc:
            raise ApiProblem(
                502, "Bad Gateway", f"{service}: {exc}", kind="bad-gateway", service=service
            ) from exc

    async def _request(self, subject: str, verb: str, payload: dict[str, Any]) -> Any:
        if verb not in READ_VERBS:
            return await self.bus.request(subject, payload, timeout=self.timeout_s)
        key = subject + " " + json.dumps(payload, sort_keys=True, default=str)
        shared = self._inflight.get(key)
        if shared is None:
            shared = asyncio.ensure_future(
                self.bus.request(subject, payload, timeout=self.timeout_s)
            )
            self._inflight[key] = shared

            def _done(task: asyncio.Future[Any], key: str = key) -> None:
                if self._inflight.get(key) is task:
                    del self._inflight[key]
                if not task.cancelled():
                    task.exception()  # retrieved here, so a failure nobody awaited is quiet

            shared.add_done_callback(_done)
        # shield: one caller going away (client disconnect) must not cancel the others' answer.
        return await asyncio.shield(shared)

    async def fetch(
        self,
        model: type[B],
        service: str,
        verb: str,
        payload: dict[str, Any] | None = None,
        *,
        missing: ApiProblem | None = None,
    ) -> B:
        """:meth:`call`, then parse the result as ``model``."""
        return parse(model, await self.call(service, verb, payload, missing=missing), service, verb)


def parse(model: type[B], data: Any, service: str, verb: str) -> B:
    """Parse a service's result; a result of the wrong shape is a 502 naming the service."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _bad_shape(exc, service, verb) from exc


def parse_list(model: type[B], data: Any, service: str, verb: str) -> list[B]:
    """Parse a list of ``model`` from a service's result (502 naming the service if wrong)."""
    adapter = _ADAPTERS.get(model)
    if adapter is None:
        adapter = _ADAPTERS[model] = TypeAdapter(list[model])  # type: ignore[valid-type]
    try:
        parsed: list[B] = adapter.validate_python(data)
        return parsed
    except ValidationError as exc:
        raise _bad_shape(exc, service, verb) from exc


_ADAPTERS: dict[type[BaseModel], TypeAdapter[Any]] = {}


def _bad_shape(exc: ValidationError, service: str, verb: str) -> ApiProblem:
    text, field = validation_message(exc)
    return ApiProblem(
        502,
        "Bad Gateway",
        f"{service}.{verb} answered with an unexpected shape: {text}",
        kind="bad-gateway",
        service=service,
        field=field,
    )


def items_of(data: Any, service: str, verb: str) -> tuple[list[Any], str | None]:
    """The items and next cursor of a list reply (a page object, or a bare list)."""
    if isinstance(data, list):
        return data, None
    if isinstance(data, dict) and isinstance(data.get("items"), list):
        cursor = data.get("next_cursor")
        return data["items"], (str(cursor) if cursor not in (None, "") else None)
    raise ApiProblem(
        502,
        "Bad Gateway",
        f"{service}.{verb} answered with {type(data).__name__}, expected a list "
        "or {items, next_cursor}",
        kind="bad-gateway",
        service=service,
    )
