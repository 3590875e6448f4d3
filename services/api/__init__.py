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
- ``TORCHRELAY_RPC_TIMEOUT_S`` (5), ``TORCHRELAY_UI_REFRESH_S`` (10), plus every
  ``ServiceSettings`` field.
- ``TORCHRELAY_TOKEN_CACHE_S`` (10): an authenticated token is remembered this long (a token
  in use is looked up again in the background in the last quarter of that time); a token
  whose stored digest is deleted (revoked) is refused at most this long afterwards.
- ``TORCHRELAY_LIST_CACHE_S`` (1): identical ``GET /v1/incidents`` queries of one token
  scope (operator, or one tenant) get the same answer, asked of the scheduler once, for at
  most this many seconds from when it was asked (0: ask every time); while the query keeps
  coming, the next answer is asked for in the background in the last quarter of that time.
  A repeated query of a remembered token is answered in front of FastAPI
  (:mod:`services.api.kept`).

The dashboard: open ``/ui/login?token=<operator token>`` once; it sets an HttpOnly cookie
for ``/ui`` and redirects to ``/ui``, which reloads itself every ``TORCHRELAY_UI_REFRESH_S``.
"""
