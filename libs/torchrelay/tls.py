"""TLS material of the NATS connections (``TORCHRELAY_NATS_TLS_*``)."""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass


@dataclass(frozen=True)
class TlsFiles:
    """TLS material for the NATS connection: a CA bundle and an optional client cert/key."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.ca or self.cert)

    @classmethod
    def from_env(cls) -> TlsFiles:
        """``TORCHRELAY_NATS_TLS_CA`` / ``_CERT`` / ``_KEY``."""
        return cls(
            os.environ.get("TORCHRELAY_NATS_TLS_CA") or None,
            os.environ.get("TORCHRELAY_NATS_TLS_CERT") or None,
            os.environ.get("TORCHRELAY_NATS_TLS_KEY") or None,
        )

    def context(self) -> ssl.SSLContext:
        """A client SSL context verifying the server against ``ca``."""
        ctx = ssl.create_default_context(cafile=self.ca)
        if self.cert:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx


__all__ = ["TlsFiles"]
