"""The generated files: the NATS server's authorization, credentials, the Redis ACL."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrelay.auth._keys import (
    AuthError,
    NKey,
)
from torchrelay.auth._roles import (
    REVOKER,
    SERVICE_ROLES,
    SYSTEM_ACCOUNT,
    USERS,
    Permissions,
    role_inbox,
    role_permissions,
)
from torchrelay.redis_acl import redis_commands

# --------------------------------------------------------------------------- generated files


def _conf_value(value: Any, indent: str = "") -> str:
    if isinstance(value, dict):
        inner = indent + "  "
        items = "\n".join(f"{inner}{k}: {_conf_value(v, inner)}" for k, v in value.items())
        return "{\n" + items + f"\n{indent}}}"
    if isinstance(value, list):
        return "[" + ", ".join(_conf_value(v, indent) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(str(value))


@dataclass
class AuthBundle:
    """The generated authentication material of one deployment (one directory)."""

    directory: Path
    issuer: NKey
    passwords: dict[str, str]
    redis_password: str
    redis_passwords: dict[str, str] = field(default_factory=dict)

    def cred_path(self, role: str) -> Path:
        """The ``user:password`` file of ``role`` (mode 0600)."""
        return self.directory / f"{role}.cred"

    @property
    def nats_conf_path(self) -> Path:
        """The ``authorization { ... }`` block to include in the server configuration."""
        return self.directory / "nats-auth.conf"

    @property
    def redis_acl_path(self) -> Path:
        """The Redis ACL file (``aclfile``): one user per service."""
        return self.directory / "redis-users.acl"

    def nats_url(self, url: str, role: str) -> str:
        """``url`` with ``role``'s user and password in it (for tools that take one URL)."""
        scheme, _, rest = url.partition("://")
        return f"{scheme}://{role}:{self.passwords[role]}@{rest}"

    def nats_authorization(self) -> str:
        """The ``authorization`` block: one user per role, and the callout for the rest."""
        users = [
            {
                "user": role,
                "password": self.passwords[role],
                "permissions": role_permissions(role).as_config(),
            }
            for role in USERS
        ]
        block = {
            "users": users,
            "auth_callout": {"issuer": self.issuer.public, "auth_users": [*USERS, REVOKER]},
        }
        revoker = Permissions(
            pub_allow=("$SYS.REQ.SERVER.PING.CONNZ", "$SYS.REQ.SERVER.*.KICK"),
            sub_allow=(f"{role_inbox(REVOKER)}.>",),
        )
        accounts = {
            SYSTEM_ACCOUNT: {
                "users": [
                    {
                        "user": REVOKER,
                        "password": self.passwords[REVOKER],
                        "permissions": revoker.as_config(),
                    }
                ]
            }
        }
        return (
            f"authorization {_conf_value(block)}\n"
            f"accounts {_conf_value(accounts)}\n"
            f"system_account: {SYSTEM_ACCOUNT}\n"
        )

    def redis_url(
        self, host: str, port: int, role: str | None = None, scheme: str = "redis"
    ) -> str:
        """The URL a process connects to Redis with (the ``default`` user's password, or
        ``role``'s own ACL user)."""
        if role is not None and role in self.redis_passwords:
            return f"{scheme}://{role}:{self.redis_passwords[role]}@{host}:{port}/0"
        return f"{scheme}://:{self.redis_password}@{host}:{port}/0"

    def redis_acl(self) -> str:
        """ACL users: ``default`` (probes, recovery) may do anything; each service only its
        own keys (``tr:<service>``, ``tr:<service>:*``), no Pub/Sub channel, and only the
        commands it uses (:func:`redis_commands`)."""
        lines = [f"user default on >{self.redis_password} ~* &* +@all"]
        for role, password in sorted(self.redis_passwords.items()):
            allowed = " ".join(f"+{c}" for c in redis_commands(role))
            lines.append(
                f"user {role} on >{password} resetkeys ~tr:{role}:* ~tr:{role} "
                f"resetchannels -@all {allowed}"
            )
        return "\n".join(lines) + "\n"


def _write_secret(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.chmod(tmp, 0o600)
    tmp.replace(path)


def _read_or_new(path: Path, make: Callable[[], str]) -> str:
    if path.exists():
        return path.read_text().strip()
    value = make()
    _write_secret(path, value)  # no newline: the value goes into URLs as it is
    return value


def ensure_bundle(directory: Path) -> AuthBundle:
    """Load the authentication material under ``directory``, generating what is missing.

    Secrets already there are kept (a restarted stack keeps its credentials); the derived
    files (``nats-auth.conf``, ``<role>.cred``, ``redis-users.acl``) are rewritten.
    """
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    issuer = NKey(_read_or_new(directory / "issuer.seed", lambda: NKey.generate().seed))

    def token() -> str:
        return secrets.token_urlsafe(24)

    secret_dir = directory / "secrets"
    secret_dir.mkdir(exist_ok=True)
    os.chmod(secret_dir, 0o700)
    passwords = {
        r: _read_or_new(secret_dir / f"nats-{r}.password", token) for r in (*USERS, REVOKER)
    }
    redis_password = _read_or_new(secret_dir / "redis-default.password", token)
    redis_passwords = {
        r: _read_or_new(secret_dir / f"redis-{r}.password", token) for r in SERVICE_ROLES
    }
    bundle = AuthBundle(directory, issuer, passwords, redis_password, redis_passwords)
    for role in (*USERS, REVOKER):
        _write_secret(bundle.cred_path(role), f"{role}:{passwords[role]}\n")
    _write_secret(bundle.nats_conf_path, bundle.nats_authorization())
    _write_secret(bundle.redis_acl_path, bundle.redis_acl())
    _write_secret(directory / "redis.password", redis_password)
    return bundle


def compose_env_lines(bundle: AuthBundle) -> str:
    """The ``.env`` lines docker-compose.yml reads the Redis passwords from."""
    lines = [f"REDIS_PASSWORD={bundle.redis_password}"]
    lines += [
        f"REDIS_{role.upper()}_PASSWORD={password}"
        for role, password in sorted(bundle.redis_passwords.items())
    ]
    return "\n".join(lines) + "\n"


def cmd_auth(args: Any) -> int:
    """``torchrelay auth init --out DIR``: the credentials of an external deployment.

    Writes (or completes, keeping existing secrets) the NATS authorization block, one
    ``user:password`` file per role, the auth-callout issuer seed, the Redis ACL file and
    ``compose.env`` (the Redis passwords for docker-compose's ``.env``).
    """
    out = Path(args.out)
    bundle = ensure_bundle(out)
    _write_secret(out / "compose.env", compose_env_lines(bundle))
    print(f"torchrelay auth: credentials in {out.resolve()} (mode 0600):")
    print(f"  {bundle.nats_conf_path.name:<22} NATS users, permissions, auth callout (servers)")
    for role in USERS:
        print(f"  {bundle.cred_path(role).name:<22} NATS credential of {role}")
    print(f"  {bundle.cred_path(REVOKER).name:<22} the scheduler's system-account user (kicks)")
    print("  issuer.seed            the scheduler signs job-scoped users with it")
    print(f"  {bundle.redis_acl_path.name:<22} Redis users (redis-server --aclfile)")
    print("  compose.env            Redis passwords: append to docker-compose's .env")
    return 0


def load_issuer(path: str | Path) -> NKey:
    """The callout issuer's seed from a file (``TORCHRELAY_AUTH_ISSUER_SEED_FILE``)."""
    try:
        return NKey(Path(path).read_text().strip())
    except OSError as exc:
        raise AuthError(f"cannot read the auth-callout issuer seed {path}: {exc}") from exc
