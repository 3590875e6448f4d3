"""What each service's Redis ACL user may run: an allow-list of exactly the commands it sends
(``torchrelay.auth.AuthBundle.redis_acl`` writes the ACL file from it)."""

from __future__ import annotations

from torchrelay.contract import SERVICES

# The Redis commands each service's ACL user may run (``-@all`` then exactly these); every
# other command is refused with NOPERM: SWAPDB, REPLICAOF, CLIENT KILL/PAUSE, SAVE, SELECT,
# KEYS, FLUSH*, CONFIG, MONITOR, PUBLISH, SCRIPT FLUSH, FUNCTION, ... A command a Lua script
# calls (``redis.call``) is checked against the script's caller, so it is listed too. A
# service that starts sending a new command needs it here, or it gets NOPERM
# (tests/integration/foundation/test_redis_acl.py runs each service's Redis work as its user).
# Left out on purpose:
# - HELLO and AUTH need no permission. redis-py's optional handshake commands (CLIENT SETINFO,
#   CLIENT MAINT_NOTIFICATIONS) are refused and redis-py ignores the refusal: a CLIENT
#   subcommand the server does not know makes Redis 7 reject the whole ACL file.
# - SELECT: redis-py sends none for database 0, and ``AuthBundle.redis_url`` ends in ``/0``.
# - CONFIG GET (billing's durability check): it would read every secret of the server's
#   configuration; refused, billing reports ``ledger_durability`` as unknown.
_REDIS_CONNECT = ("ping",)  # service.connect_redis, the detector's warm-up, the API's readiness
_REDIS_DEDUPE = ("exists", "set")  # bus.RedisDeduper, behind every ServiceContext.consume
_REDIS_SCRIPTS = ("evalsha", "script|load")  # register_script: EVALSHA, SCRIPT LOAD on NOSCRIPT
_REDIS_MULTI = ("multi", "exec")  # pipeline(transaction=True)
# torchrelay.leadership: SET NX PX to take the lease, scripts to renew and release it
# (PEXPIRE, DEL inside them), for the services that elect a leader among replicas.
_REDIS_LEADER = ("set", "get", "pexpire", "del", *_REDIS_SCRIPTS)
_REDIS_COMMANDS: dict[str, tuple[str, ...]] = {
    # services/api/auth.py TokenStore (no consumer: no dedupe)
    "api": (
        *_REDIS_CONNECT,
        *_REDIS_MULTI,
        *("get", "set", "del", "hget", "hgetall", "hset", "hsetnx", "hdel"),
    ),
    # services/billing/ledger.py (Ledger, and in APPEND_LUA / CREATE_CONTRACT_LUA)
    "billing": (
        *_REDIS_CONNECT,
        *_REDIS_LEADER,
        *_REDIS_DEDUPE,
        *_REDIS_SCRIPTS,
        *_REDIS_MULTI,
        *("get", "mget", "hget", "hmget", "hgetall", "hset", "hsetnx", "hincrby"),
        *("rpush", "lrange", "lindex", "sadd", "sismember", "smembers"),
        *("zadd", "zrange", "zrangebyscore", "zrevrangebyscore"),
    ),
    # services/detector/state.py (its stores, and in their Lua) and service.py
    "detector": (
        *_REDIS_CONNECT,
        *_REDIS_DEDUPE,
        *_REDIS_SCRIPTS,
        "eval",
        *("get", "del", "expire", "hexists", "hget", "hgetall", "hlen", "hset", "hvals"),
        *("sadd", "sismember", "smembers", "zadd", "zrangebyscore", "zrem", "zremrangebyscore"),
    ),
    # services/migration_executor/store.py (ExecutorStore, and in its Lua) and service.py.
    "migration_executor": (
        *_REDIS_CONNECT,
        *_REDIS_LEADER,
        *_REDIS_DEDUPE,
        *_REDIS_MULTI,
        "eval",
        *("get", "del", "expire", "hexists", "hgetall", "hlen", "hmget", "hset"),
        *("sadd", "scard", "smembers", "srem", "zadd", "zrevrange"),
    ),
    # services/scheduler/registry.py (WATCH/MULTI/EXEC; UNWATCH on reset), incidents.py,
    # their Lua, torchrelay.auth.JobCredentialStore (credentials.py) and the hosts'
    # rendezvous (hosts.py, in its Lua)
    "scheduler": (
        *_REDIS_CONNECT,
        *_REDIS_LEADER,
        *_REDIS_DEDUPE,
        *_REDIS_MULTI,
        *("watch", "unwatch", "eval"),
        *("get", "mget", "del", "expire", "hget", "hgetall", "hset"),
        # the agents' step times per job (registry.py: record_step_times, step_time)
        *("hincrby", "hincrbyfloat", "hmget"),
        *("sadd", "scard", "smembers", "srem"),
        *("zadd", "zrange", "zrevrange", "zrevrangebyscore"),
    ),
    # services/spare_pool/inventory.py (Inventory, and in its Lua library and scripts)
    "spare_pool": (
        *_REDIS_CONNECT,
        *_REDIS_DEDUPE,
        *_REDIS_SCRIPTS,
        *_REDIS_MULTI,
        *("get", "del", "persist", "pexpire", "time"),
        *("hdel", "hget", "hgetall", "hkeys", "hmget", "hset", "hsetnx"),
        *("rpush", "lrange", "ltrim", "sadd", "smembers", "srem"),
        *("zadd", "zrange", "zrangebylex", "zrangebyscore", "zrem", "zscore"),
    ),
}


def redis_commands(role: str) -> tuple[str, ...]:
    """The Redis commands ``role``'s ACL user may run, sorted (``command|subcommand`` for a
    subcommand).

    Raises:
        ValueError: ``role`` is not a service with a Redis user.
    """
    if role not in _REDIS_COMMANDS:
        raise ValueError(f"no Redis user for {role!r}: expected one of {', '.join(SERVICES)}")
    return tuple(sorted(set(_REDIS_COMMANDS[role])))


__all__ = ["redis_commands"]
