"""Errors as RFC 9457 problem documents: the app's exception handlers.

Routes raise :class:`~services.api.gateway.ApiProblem` (or one of its makers there:
``not_found``, ``invalid``, ``unauthorized``, ``forbidden``); FastAPI's own validation and
HTTP errors, and anything unexpected, are answered in the same shape here.
:data:`ERROR_STATUSES` is what the OpenAPI document says of each error status of a ``/v1``
operation (:mod:`services.api.openapi`).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.api.gateway import ApiProblem

log = logging.getLogger("torchrelay.api")

PROBLEM_JSON = "application/problem+json"

TITLES = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    415: "Unsupported Media Type",
    422: "Invalid request",
}

ERROR_STATUSES = {
    "400": "bad request",
    "401": "no or unknown bearer token",
    "403": "an operator route called with a tenant token",
    "404": "no such object (or another tenant's)",
    "409": "conflicts with the current state",
    "413": "the request body is over TORCHRELAY_API_MAX_BODY_BYTES (default 1 MiB): refused "
    "before it is read and before the token is checked; `field` is `body`",
    "422": "invalid input; `field` names it",
    "502": "a service answered with an error or an unexpected shape",
    "503": "the service that owns the data is not answering; `service` names it",
}


def problem_response(problem: ApiProblem, request: Request) -> JSONResponse:
    """``problem`` as its problem+json response, ``instance`` the request's path."""
    return JSONResponse(
        problem.document(str(request.url.path)),
        status_code=problem.status,
        media_type=PROBLEM_JSON,
        headers=problem.headers,
    )


def validation_problem(exc: RequestValidationError) -> ApiProblem:
    """FastAPI's validation error as one 422 problem: ``field`` names the first bad input,
    ``errors`` lists up to 20 of them (``from_`` is the query's ``from``)."""
    errors = []
    for err in exc.errors()[:20]:
        loc = [str(p) for p in err.get("loc", ())]
        where = loc[0] if loc else "body"
        field = ".".join(loc[1:]) or where
        if err.get("type") == "json_invalid":
            field = "body"
        if where == "query" and field == "from_":
            field = "from"
        errors.append({"field": field, "in": where, "message": str(err.get("msg", ""))})
    first = errors[0] if errors else {"field": "body", "message": "invalid request"}
    detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors[:5])
    return ApiProblem(
        422, "Invalid request", detail, kind="invalid", field=first["field"], errors=errors
    )


def http_problem(exc: StarletteHTTPException) -> ApiProblem:
    """Starlette's HTTP error (404 of an unknown path, 405, ...) as a problem."""
    return ApiProblem(
        exc.status_code,
        TITLES.get(exc.status_code, "Error"),
        str(exc.detail),
        kind=f"http-{exc.status_code}",
        headers=dict(exc.headers or {}) or None,
    )


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` with a problem document."""

    @app.exception_handler(ApiProblem)
    async def on_problem(request: Request, exc: ApiProblem) -> JSONResponse:
        return problem_response(exc, request)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return problem_response(validation_problem(exc), request)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return problem_response(http_problem(exc), request)

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return problem_response(
            ApiProblem(
                500,
                "Internal Server Error",
                f"{type(exc).__name__}; see the api log",
                kind="internal",
            ),
            request,
        )
