"""The portal API service: FastAPI over every service's NATS request/reply verbs.

``python -m services.api`` runs it (uvicorn on ``TORCHRELAY_HTTP_HOST``/``TORCHRELAY_HTTP_PORT``;
port 0 picks a free one and the bound port is printed as one JSON line and logged as
``ready``). :func:`services.api.app.create_app` builds the app and
:func:`services.api.app.openapi_document` its OpenAPI document (``make proto`` writes it to
``proto/openapi.json``).

Settings (``services.api.settings.ApiSettings``, prefix ``TORCHRELAY_``):

- ``TORCHRELAY_OPERATOR_TOKEN``: the first operator token; its hash is stored at start. In
  ``production`` a missing, short (< 24 characters), ``trdev_`` or placeholder value is
  refused. In development, without it, a ``trdev_`` token is generated and logged.
- ``TORCHRELAY_TOKEN_PEPPER``: the HMAC key of stored token hashes (else one is generated and
  kept in Redis under ``tr:api:pepper``).
- ``TORCHRELAY_RPC_TIMEOUT_S`` (5), ``TORCHRELAY_TOKEN_CACHE_S`` (10),
  ``TORCHRELAY_UI_REFRESH_S`` (10), plus every ``ServiceSettings`` field.
- ``TORCHRELAY_LIST_CACHE_S`` (1): identical ``GET /v1/incidents`` queries of one token
  scope (operator, or one tenant) within this many seconds get the same answer, asked of
  the scheduler once (0: ask every time).

The dashboard: open ``/ui/login?token=<operator token>`` once; it sets an HttpOnly cookie
for ``/ui`` and redirects to ``/ui``, which reloads itself every ``TORCHRELAY_UI_REFRESH_S``.
"""
