"""The API process's settings (environment prefix ``TORCHRELAY_``).

Outside development the first operator token must come from ``TORCHRELAY_OPERATOR_TOKEN``
and a missing, short, development or placeholder secret is refused at start, as the FastAPI
full-stack template refuses ``changethis``.
"""

from __future__ import annotations

from pydantic import Field, SecretStr, ValidationInfo, field_validator

from torchrelay.settings import DEV_OPERATOR_TOKEN_PREFIX, ServiceSettings

MIN_OPERATOR_TOKEN_LEN = 24
# TORCHRELAY_API_MAX_BODY_BYTES's default: 1 MiB, far above any JSON body the API takes.
DEFAULT_MAX_BODY_BYTES = 1024 * 1024
# Fragments of the placeholders people paste from examples.
_PLACEHOLDERS = (
    "changeme",
    "changethis",
    "change-me",
    "change_me",
    "example",
    "default",
    "password",
    "secret",
    "replace",
)


def operator_token_problem(token: str | None) -> str | None:
    """Why ``token`` may not be a production operator token, or None if it may.

    A pure rule so it is tested without a process: refuses a missing secret, one shorter
    than 24 characters, a development token (``trdev_``), a placeholder, and one with too
    little variety to be random.
    """
    hint = (
        "set TORCHRELAY_OPERATOR_TOKEN to a random secret of at least "
        f"{MIN_OPERATOR_TOKEN_LEN} characters, e.g. the output of "
        "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
    )
    if not token:
        return f"TORCHRELAY_OPERATOR_TOKEN is required in production; {hint}"
    if len(token) < MIN_OPERATOR_TOKEN_LEN:
        return (
            f"TORCHRELAY_OPERATOR_TOKEN is {len(token)} characters, shorter than "
            f"{MIN_OPERATOR_TOKEN_LEN}; {hint}"
        )
    if token.startswith(DEV_OPERATOR_TOKEN_PREFIX):
        return (
            f"TORCHRELAY_OPERATOR_TOKEN is a development token ({DEV_OPERATOR_TOKEN_PREFIX}"
            f"...), refused in production; {hint}"
        )
    lowered = token.lower()
    if any(p in lowered for p in _PLACEHOLDERS) or len(set(token)) < 8:
        return f"TORCHRELAY_OPERATOR_TOKEN looks like a placeholder, not a secret; {hint}"
    return None


class ApiSettings(ServiceSettings):
    """Settings of the ``api`` process."""

    operator_token: SecretStr | None = Field(default=None, validate_default=True)
    # HMAC key for stored token hashes; without it one is generated and kept in Redis.
    token_pepper: SecretStr | None = None
    rpc_timeout_s: float = Field(default=5.0, gt=0, le=120)
    # Authenticated tokens are remembered this long to keep Redis off the hot path.
    token_cache_s: float = Field(default=10.0, ge=0, le=600)
    # Identical list queries of one token scope are answered from the last answer this long.
    list_cache_s: float = Field(default=1.0, ge=0, le=60)
    ui_refresh_s: int = Field(default=10, ge=1, le=3600)
    # Goodput's counterfactual (docs/design.md §14): the operator's checkpoint interval for a
    # job that writes none, the time one checkpoint restart takes (the u0 of Kokolis et al.,
    # the goodput bench's), and a price per GPU-hour where the contract names none.
    goodput_checkpoint_every: int = Field(default=1000, ge=1, le=10**9)
    goodput_restart_s: float = Field(default=300.0, ge=0, le=10**7)
    goodput_price_per_gpu_hour_minor: int | None = Field(default=None, ge=0, le=10**15)
    goodput_currency: str | None = Field(default=None, pattern=r"^[A-Z]{3}$")
    # Request bodies larger than this are refused with 413 before they are read and before
    # the token is checked (TORCHRELAY_API_MAX_BODY_BYTES; services/api/limits.py).
    max_body_bytes: int = Field(
        default=DEFAULT_MAX_BODY_BYTES,
        ge=1024,
        le=1024**3,
        validation_alias="TORCHRELAY_API_MAX_BODY_BYTES",
    )

    @field_validator("operator_token")
    @classmethod
    def _operator_token(cls, value: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        if info.data.get("environment") != "production":
            return value
        problem = operator_token_problem(value.get_secret_value() if value else None)
        if problem:
            raise ValueError(problem)
        return value
