"""Who may say what on the bus: roles, NATS permissions, credentials and job-scoped users.

Every trusted process (each service, the detector node agents, the launcher, the operator's
CLI) connects with its own static NATS user whose permissions the generated server
configuration lists (:func:`role_permissions`). Every other connection -- the training
processes of a job -- goes through NATS *auth callout*: the server sends an authorization
request JWT to ``$SYS.REQ.USER.AUTH``; the scheduler's responder checks the job credential
the launcher obtained for that job (:class:`JobCredentialStore`) and answers with a user JWT
that may publish only the job's heartbeat and report subjects and read only the job's own
generation key (:func:`job_permissions`), expiring with the credential.

The JWTs are NATS's ``ed25519-nkey`` JWTs; nkeys (base32 of prefix byte + key + CRC-16) are
encoded on PyNaCl.

``_keys`` holds nkeys and JWTs, ``_roles`` the roles' permissions, ``_callout`` the job
credentials and the callout, ``_bundle`` the generated files; every name is importable here.
"""

from __future__ import annotations

from torchrelay.auth._bundle import (
    AuthBundle,
    cmd_auth,
    compose_env_lines,
    ensure_bundle,
    load_issuer,
)
from torchrelay.auth._callout import (
    CredentialRefused,
    JobCredentialStore,
    JobGrant,
    Lookup,
    answer_authorization,
    kick_user,
)
from torchrelay.auth._keys import (
    AuthError,
    NKey,
    decode_jwt,
    encode_jwt,
    verify_key,
)
from torchrelay.auth._roles import (
    ADMIN,
    CALLOUT_SUBJECT,
    DEFAULT_JOB_TTL_S,
    GENERATIONS_STREAM,
    JOB_INBOX_PREFIX,
    JOB_USER_PREFIX,
    KV_PREFIX,
    REVOKER,
    ROLE_INBOX_PREFIX,
    ROLES,
    SERVICE_ROLES,
    SYSTEM_ACCOUNT,
    USERS,
    Permissions,
    generation_direct_get,
    job_inbox_prefix,
    job_permissions,
    job_user,
    role_inbox,
    role_permissions,
)
from torchrelay.redis_acl import redis_commands

__all__ = [
    "ADMIN",
    "CALLOUT_SUBJECT",
    "DEFAULT_JOB_TTL_S",
    "GENERATIONS_STREAM",
    "JOB_INBOX_PREFIX",
    "JOB_USER_PREFIX",
    "KV_PREFIX",
    "REVOKER",
    "ROLES",
    "ROLE_INBOX_PREFIX",
    "SERVICE_ROLES",
    "SYSTEM_ACCOUNT",
    "USERS",
    "AuthBundle",
    "AuthError",
    "CredentialRefused",
    "JobCredentialStore",
    "JobGrant",
    "Lookup",
    "NKey",
    "Permissions",
    "answer_authorization",
    "cmd_auth",
    "compose_env_lines",
    "decode_jwt",
    "encode_jwt",
    "ensure_bundle",
    "generation_direct_get",
    "job_inbox_prefix",
    "job_permissions",
    "job_user",
    "kick_user",
    "load_issuer",
    "redis_commands",
    "role_inbox",
    "role_permissions",
    "verify_key",
]
