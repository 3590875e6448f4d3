"""The OpenAPI document of the portal API: FastAPI's, with problem+json errors.

Every ``/v1`` operation lists the error statuses of :data:`services.api.errors.ERROR_STATUSES`
as RFC 9457 problem documents (a route's own description of a status is kept); FastAPI's
validation-error schemas are replaced by ``Problem``. ``make proto`` writes the document to
``proto/openapi.json`` (:func:`services.api.app.openapi_document`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from services.api.errors import ERROR_STATUSES, PROBLEM_JSON
from services.api.models import Problem


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document with problem+json errors on every ``/v1`` operation (made once,
    then kept on the app as FastAPI keeps its own)."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=app.routes,
        tags=app.openapi_tags,
    )
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["Problem"] = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
    problem = {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}}
    for path, operations in doc.get("paths", {}).items():
        for op in operations.values():
            responses = op.setdefault("responses", {})
            # FastAPI's own 422 (its validation error shape) is replaced by the problem's.
            if responses.get("422", {}).get("description") == "Validation Error":
                responses.pop("422")
            if path.startswith("/v1/"):
                for status, text in ERROR_STATUSES.items():
                    # A route's own description of a status says more than the generic one.
                    given = responses.get(status, {}).get("description")
                    responses[status] = {"description": given or text, "content": problem}
            elif path == "/readyz":
                responses["503"] = {
                    "description": "not ready",
                    "content": {"application/json": {"schema": {"type": "object"}}},
                }
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    app.openapi_schema = doc
    return doc
