"""Settings: one pydantic-settings class per process, environment prefix ``TORCHRELAY_``.

``NATS_URL`` and ``REDIS_URL`` are read without the prefix (docs/interfaces.md). A setting that
is missing or malformed fails at start with a message naming the variable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypeVar

from pydantic import AliasChoices, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEV_OPERATOR_TOKEN_PREFIX = "trdev_"  # noqa: S105 - a marker, not a secret


class SettingsError(RuntimeError):
    """A setting is missing or malformed; the message names the environment variable."""


def _check_url(value: str, schemes: tuple[str, ...], env: str) -> str:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{env}={value!r} is not a valid URL: {exc}") from exc
    if parts.scheme not in schemes or not parts.hostname:
        raise ValueError(
            f"{env}={value!r} is not a valid URL: expected {' or '.join(schemes)}://host:port"
        )
    del port
    return value


class CommonSettings(BaseSettings):
    """Settings every torchrelay process shares."""

    model_config = SettingsConfigDict(
        env_prefix="TORCHRELAY_", extra="ignore", populate_by_name=True
    )

    nats_url: str = Field(
        default="nats://127.0.0.1:4222",
        validation_alias=AliasChoices("NATS_URL", "TORCHRELAY_NATS_URL"),
    )
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("REDIS_URL", "TORCHRELAY_REDIS_URL"),
    )
    nats_credentials: Path | None = None
    # TLS to NATS (a tls:// URL, or a server that requires it): CA bundle, client cert/key.
    nats_tls_ca: Path | None = None
    nats_tls_cert: Path | None = None
    nats_tls_key: Path | None = None
    cluster: str = Field(default="local", pattern=r"^[A-Za-z0-9_\-]+$")
    home: Path = Path(".torchrelay")
    environment: Literal["development", "production", "test"] = "development"
    log_level: str = "INFO"
    log_json: bool = True
    otlp_endpoint: str | None = None
    trace_file: str | None = None
    stream_replicas: int = Field(default=1, ge=1, le=5)
    connect_timeout_s: float = Field(default=10.0, gt=0)

    @field_validator("nats_url")
    @classmethod
    def _nats_url(cls, v: str) -> str:
        return ",".join(
            _check_url(u.strip(), ("nats", "tls", "ws", "wss"), "NATS_URL") for u in v.split(",")
        )

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str) -> str:
        return _check_url(v, ("redis", "rediss", "unix"), "REDIS_URL")


class ServiceSettings(CommonSettings):
    """Settings of a control-plane service process."""

    http_host: str = "127.0.0.1"
    http_port: int = Field(default=0, ge=0, le=65535)
    redis_password_required: bool = False
    # The scheduler's auth-callout issuer seed (job-scoped NATS users); see torchrelay.auth.
    auth_issuer_seed_file: Path | None = None
    # The scheduler's system-account user that closes a revoked job's connections.
    nats_revoker_credentials: Path | None = None
    # An elected service's leader lease (torchrelay.leadership): a standby takes over this
    # long after its leader died or froze.
    leader_ttl_s: float = Field(default=2.0, ge=0.1, le=60)

    @model_validator(mode="after")
    def _production_needs_auth(self) -> ServiceSettings:
        if (
            self.environment == "production"
            and self.redis_password_required
            and "@" not in self.redis_url
        ):
            raise ValueError("REDIS_URL has no password; production refuses an open Redis")
        return self


S = TypeVar("S", bound=CommonSettings)


def load_settings(cls: type[S], **overrides: object) -> S:
    """Build settings from the environment, turning validation errors into SettingsError."""
    try:
        return cls(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "settings"
            env = (
                loc.upper()
                if loc.upper() in {"NATS_URL", "REDIS_URL"}
                else f"TORCHRELAY_{loc.upper()}"
            )
            problems.append(f"{env}: {err['msg']}")
        raise SettingsError("invalid settings: " + "; ".join(problems)) from exc
