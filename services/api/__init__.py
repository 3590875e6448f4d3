"""The portal API service: FastAPI over every service's NATS request/reply verbs.

``python -m services.api`` runs it; :func:`services.api.app.create_app` builds the app and
:func:`services.api.app.openapi_document` its OpenAPI document (written to ``proto/``).
"""
