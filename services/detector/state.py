"""The detector's state: episodes, jobs, nodes and replicas in Redis (under ``tr:detector``).

What must agree across replicas lives here, behind atomic operations: opening an episode
(so one episode yields one fault whichever replica sees it), a node's health (so the
circuit breaker counts every replica's decisions), the job directory (which member holds
which rank on which slot, from the durable reports). Per-GPU windows and per-job heartbeat
progress stay in the memory of the replica that owns the node or job (see README.md).
"""

from __future__ import annotations

import json
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, cast

import redis.asyncio as aioredis

from services.detector.rules import (
    HEALTH_RANK,
    OUT_OF_SERVICE,
    DetectorConfig,
    Episode,
    MemberProgress,
    StragglerTracker,
    episode_step,
    lemon_update,
)
from torchrelay.contract import (
    GenerationChanged,
    JobRegistered,
    NodeHealth,
    Role,
)

# Open the next episode of a key unless one is open and recent (mirrors rules.episode_step),
# or (mode "extend") only move an open episode's last-seen time forward.
# KEYS[1] episode hash, KEYS[2] (optional) the node's set of episode keys;
# ARGV: at, quiet_s, ttl_s, mode. Returns {is_new, number, first_seen}.
_EPISODE_LUA = """
local n = tonumber(redis.call('HGET', KEYS[1], 'n') or '0')
local open = redis.call('HGET', KEYS[1], 'open') == '1'
local last = tonumber(redis.call('HGET', KEYS[1], 'last') or '0')
local at = tonumber(ARGV[1])
if ARGV[4] == 'extend' or (open and at - last <= tonumber(ARGV[2])) then
  if open and at > last then redis.call('HSET', KEYS[1], 'last', ARGV[1]) end
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  return {0, n, redis.call('HGET', KEYS[1], 'first') or ARGV[1]}
end
n = n + 1
redis.call('HSET', KEYS[1], 'n', n, 'open', '1', 'first', ARGV[1], 'last', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
if KEYS[2] then redis.call('SADD', KEYS[2], KEYS[1]) end
return {1, n, ARGV[1]}
"""

# Raise a node's health through the circuit breaker, atomically across replicas.
# KEYS[1] health hash (node -> health), KEYS[2] nodes hash (node -> inventory).
# ARGV: node, new health, max_share, min_nodes. Returns {outcome, previous, out, total}.
_HEALTH_LUA = """
local rank = {healthy=0, degraded=1, unhealthy=2, quarantined=3, lemon=4}
local node, new = ARGV[1], ARGV[2]
local cur = redis.call('HGET', KEYS[1], node) or 'healthy'
if rank[cur] >= rank[new] then return {'unchanged', cur, 0, 0} end
if rank[new] < 2 or rank[cur] >= 2 then
  redis.call('HSET', KEYS[1], node, new)
  return {'ok', cur, 0, 0}
end
local out = 0
for _, h in ipairs(redis.call('HVALS', KEYS[1])) do
  if rank[h] ~= nil and rank[h] >= 2 then out = out + 1 end
end
local total = redis.call('HLEN', KEYS[2])
if total < 1 then total = 1 end
local allowed = math.max(tonumber(ARGV[4]), math.floor(tonumber(ARGV[3]) * total))
if out + 1 > allowed then return {'refused', cur, out, total} end
redis.call('HSET', KEYS[1], node, new)
return {'ok', cur, out, total}
"""

# Keep the newest generation of a job. KEYS[1] gen key; ARGV: generation, json.
_GENERATION_LUA = """
local cur = redis.call('HGET', KEYS[1], 'generation')
if cur and tonumber(cur) >= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'generation', ARGV[1], 'ranks', ARGV[2])
return 1
"""

# Who holds a slot: the job on it, then (same trip) whether it finished, its tenant and its
# newest ranks. KEYS[1] slot key; ARGV[1] the job keys' prefix ("<prefix>:job:").
_SLOT_HOLDER_LUA = """
local job = redis.call('GET', KEYS[1])
if not job then return false end
local base = ARGV[1] .. job .. ':'
return {job, redis.call('EXISTS', base .. 'finished'),
        redis.call('HGET', base .. 'meta', 'tenant'), redis.call('HGET', base .. 'gen', 'ranks')}
"""

EPISODE_TTL_S = 30 * 24 * 3600
JOB_TTL_S = 7 * 24 * 3600


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class EpisodeStore:
    """One episode per (GPU or member, kind), shared by every replica through Redis.

    For sample-driven findings the replica that owns the GPU decides locally, in sample
    order, whether a finding opens a new episode or extends the open one (:meth:`observe`);
    Redis mirrors that decision so that replicas agree (:meth:`sync`): a new episode is
    opened there atomically (another replica may have opened it already: then no fault), an
    ongoing one is extended at most every ``quiet_s / 4`` of sample time. One sync task per
    key at a time, so a burst of samples costs one round trip, not one per sample.
    """

    def __init__(self, redis: aioredis.Redis, prefix: str, cfg: DetectorConfig) -> None:
        self._redis = redis
        self._prefix = prefix
        self._cfg = cfg
        self._script = redis.register_script(_EPISODE_LUA)
        self._shadow: dict[str, Episode] = {}
        self._told: dict[str, float] = {}
        self._opens: dict[str, deque[float]] = {}
        self._pending: set[str] = set()

    def key(self, *parts: object) -> str:
        """The Redis key of an episode."""
        return f"{self._prefix}:ep:" + ":".join(str(p) for p in parts)

    def _quiet(self, quiet_s: float | None) -> float:
        return self._cfg.episode_quiet_s if quiet_s is None else quiet_s

    def observe(self, key: str, at: float, quiet_s: float | None = None) -> bool:
        """A finding at ``at``; True when a :meth:`sync` task must be started for ``key``."""
        quiet = self._quiet(quiet_s)
        ep = self._shadow.get(key)
        if ep is None:
            if len(self._shadow) > 200_000:
                old = next(iter(self._shadow))
                self._shadow.pop(old)
                self._told.pop(old, None)
            ep = self._shadow[key] = Episode()
        if episode_step(ep, at, quiet):
            self._opens.setdefault(key, deque()).append(at)
        elif key not in self._opens and at - self._told.get(key, at) < quiet / 4:
            return False
        if key in self._pending:
            return False  # the running sync task picks this up
        self._pending.add(key)
        return True

    async def sync(
        self, key: str, node_index: str | None = None, quiet_s: float | None = None
    ) -> list[tuple[int, float]]:
        """Mirror the key's local decisions into Redis; returns the episodes it opened there
        first (number, first seen) - each is one fault to publish."""
        quiet = self._quiet(quiet_s)
        opened: list[tuple[int, float]] = []
        keys = [key] if node_index is None else [key, node_index]
        try:
            while True:
                opens = self._opens.get(key)
                if opens:
                    at = opens.popleft()
                    mode = "open"
                else:
                    self._opens.pop(key, None)
                    ep = self._shadow.get(key)
                    told = self._told.get(key)
                    if ep is None or (told is not None and ep.last_seen - told < quiet / 4):
                        return opened
                    at, mode = ep.last_seen, "extend"
                res = await self._script(
                    keys=keys, args=[repr(at), repr(quiet), EPISODE_TTL_S, mode]
                )
                self._told[key] = max(self._told.get(key, at), at)
                is_new, number, first = int(res[0]), int(res[1]), float(_s(res[2]))
                ep = self._shadow.get(key)
                if ep is not None and mode == "open":
                    ep.number = number
                if is_new:
                    opened.append((number, first))
        finally:
            self._pending.discard(key)

    async def open(
        self, key: str, at: float, quiet_s: float | None = None, node_index: str | None = None
    ) -> tuple[bool, int, float]:
        """Record a rare finding (a lost or hung member) straight in Redis:
        (opened a new episode?, its number, its first time)."""
        keys = [key] if node_index is None else [key, node_index]
        res = await self._script(
            keys=keys, args=[repr(at), repr(self._quiet(quiet_s)), EPISODE_TTL_S, "open"]
        )
        return bool(int(res[0])), int(res[1]), float(_s(res[2]))

    async def open_and_get(
        self, key: str, at: float, also: str | None, quiet_s: float | None = None
    ) -> tuple[tuple[bool, int, float], bytes | None]:
        """:meth:`open`, and GET ``also`` in the same round trip (EVAL, not EVALSHA: a
        pipeline with a registered script first asks the server whether it has it)."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.eval(_EPISODE_LUA, 1, key, repr(at), repr(self._quiet(quiet_s)), EPISODE_TTL_S, "open")
        if also is not None:
            pipe.get(also)
        got = await pipe.execute()
        res = got[0]
        return (bool(int(res[0])), int(res[1]), float(_s(res[2]))), (
            got[1] if also is not None else None
        )

    async def close_node(self, node_index: str) -> int:
        """Close every open episode of a node (it was returned to service)."""
        keys = [_s(k) for k in await self._redis.smembers(node_index)]
        for k in keys:
            await self._redis.hset(k, "open", "0")
            self._shadow.pop(k, None)
            self._told.pop(k, None)
        await self._redis.delete(node_index)
        return len(keys)


@dataclass(frozen=True)
class SlotHolder:
    """Who holds a (node, gpu) slot in a job's newest generation."""

    job_id: str
    member_id: str | None
    rank: int | None
    tenant: str | None


@dataclass(frozen=True)
class ExitContext:
    """What the detector needs to judge a member's exit, read in one round trip."""

    app_error: bool
    finished: bool
    ranks: tuple[int, list[dict[str, Any]]] | None
    cluster: str


def _ranks(raw: dict[Any, Any]) -> tuple[int, list[dict[str, Any]]] | None:
    if not raw:
        return None
    data = {_s(k): _s(v) for k, v in raw.items()}
    return int(data["generation"]), cast(list[dict[str, Any]], json.loads(data["ranks"]))


class JobDirectory:
    """Which member of which job holds which rank on which slot (from the durable reports)."""

    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self._r = redis
        self._p = prefix
        self._gen_script = redis.register_script(_GENERATION_LUA)
        self._holder_script = redis.register_script(_SLOT_HOLDER_LUA)

    def _k(self, job_id: str, what: str) -> str:
        return f"{self._p}:job:{job_id}:{what}"

    def _slot(self, cluster: str, node: str, gpu: int) -> str:
        return f"{self._p}:slot:{cluster}:{node}:{gpu}"

    async def register(self, ev: JobRegistered) -> None:
        """A job started: its members, cluster and the provisional ranks (workers in order)."""
        members = {
            m.member_id: {"node": m.node, "gpu": m.gpu, "role": m.role.value} for m in ev.members
        }
        pipe = self._r.pipeline(transaction=False)
        pipe.hset(
            self._k(ev.job_id, "meta"),
            mapping={"tenant": ev.tenant, "cluster": ev.cluster, "world_size": ev.world_size},
        )
        if members:
            pipe.hset(
                self._k(ev.job_id, "members"),
                mapping={k: json.dumps(v) for k, v in members.items()},
            )
        for m in ev.members:
            pipe.set(self._slot(ev.cluster, m.node, m.gpu), ev.job_id, ex=JOB_TTL_S)
        for what in ("meta", "members"):
            pipe.expire(self._k(ev.job_id, what), JOB_TTL_S)
        await pipe.execute()
        workers = [m for m in ev.members if m.role == Role.WORKER]
        ranks = [
            {"rank": i, "member_id": m.member_id, "node": m.node, "gpu": m.gpu}
            for i, m in enumerate(workers)
        ]
        # Generation 0: what the launcher planned, until the executor writes generation 1.
        await self._gen_script(keys=[self._k(ev.job_id, "gen")], args=[0, json.dumps(ranks)])

    async def add_member(
        self, job_id: str, member_id: str, node: str, gpu: int, role: str, cluster: str
    ) -> None:
        """A member joined (cold spares appear only this way)."""
        await self._r.hset(
            self._k(job_id, "members"),
            member_id,
            json.dumps({"node": node, "gpu": gpu, "role": role}),
        )
        await self._r.set(self._slot(cluster, node, gpu), job_id, ex=JOB_TTL_S)

    async def set_generation(self, ev: GenerationChanged) -> bool:
        """Record a newer generation (older or repeated ones are ignored)."""
        ranks = [a.model_dump() for a in ev.ranks]
        applied = bool(
            await self._gen_script(
                keys=[self._k(ev.job_id, "gen")], args=[ev.generation, json.dumps(ranks)]
            )
        )
        if applied:
            cluster = await self.cluster_of(ev.job_id)
            pipe = self._r.pipeline(transaction=False)
            for a in ev.ranks:
                pipe.set(self._slot(cluster, a.node, a.gpu), ev.job_id, ex=JOB_TTL_S)
            pipe.expire(self._k(ev.job_id, "gen"), JOB_TTL_S)
            await pipe.execute()
        return applied

    async def cluster_of(self, job_id: str) -> str:
        """The job's cluster (``local`` if it was never registered)."""
        v = await self._r.hget(self._k(job_id, "meta"), "cluster")
        return _s(v) if v else "local"

    async def tenant_of(self, job_id: str) -> str | None:
        """The job's tenant, if registered."""
        v = await self._r.hget(self._k(job_id, "meta"), "tenant")
        return _s(v) if v else None

    async def ranks(self, job_id: str) -> tuple[int, list[dict[str, Any]]] | None:
        """The newest generation's number and rank assignments, or None if unknown."""
        return _ranks(await self._r.hgetall(self._k(job_id, "gen")))

    async def ranks_and_cluster(
        self, job_id: str
    ) -> tuple[tuple[int, list[dict[str, Any]]] | None, str]:
        """:meth:`ranks` and :meth:`cluster_of` in one round trip."""
        pipe = self._r.pipeline(transaction=False)
        pipe.hgetall(self._k(job_id, "gen"))
        pipe.hget(self._k(job_id, "meta"), "cluster")
        gen, cluster = await pipe.execute()
        return _ranks(gen), _s(cluster) if cluster else "local"

    async def rank_of(self, job_id: str, member_id: str) -> int | None:
        """The rank ``member_id`` holds in the newest generation (None: not, or unknown job)."""
        got = await self.ranks(job_id)
        if got is None:
            return None
        for a in got[1]:
            if a["member_id"] == member_id:
                return int(a["rank"])
        return None

    async def member_of_rank(self, job_id: str, rank: int) -> dict[str, Any] | None:
        """The assignment of ``rank`` in the newest generation."""
        got = await self.ranks(job_id)
        if got is None:
            return None
        for a in got[1]:
            if int(a["rank"]) == rank:
                return a
        return None

    async def member(self, job_id: str, member_id: str) -> dict[str, Any] | None:
        """What the job's registration or JOINED report said of a member (node, gpu, role)."""
        raw = await self._r.hget(self._k(job_id, "members"), member_id)
        return None if raw is None else cast(dict[str, Any], json.loads(_s(raw)))

    async def slot_holder(self, cluster: str, node: str, gpu: int) -> SlotHolder | None:
        """The job member holding (node, gpu) in its newest generation, if any."""
        # One round trip (on the path of every GPU fault): a script follows the slot to its job.
        got = await self._holder_script(
            keys=[self._slot(cluster, node, gpu)], args=[f"{self._p}:job:"]
        )
        if not got:
            return None
        job, finished, tenant_raw, ranks = got
        if int(finished):
            return None
        job_id = _s(job)
        tenant = _s(tenant_raw) if tenant_raw else None
        if ranks:
            for a in json.loads(_s(ranks)):
                if a["node"] == node and int(a["gpu"]) == gpu:
                    return SlotHolder(job_id, a["member_id"], int(a["rank"]), tenant)
        return SlotHolder(job_id, None, None, tenant)

    def slot_fault_key(self, cluster: str, node: str, gpu: int) -> str:
        """Where :meth:`note_slot_fault` keeps a slot's recent GPU fault."""
        return f"{self._slot(cluster, node, gpu)}:fault"

    @staticmethod
    def parse_slot_fault(raw: bytes | str | None) -> tuple[str, str] | None:
        """(fault_id, kind) from the value at :meth:`slot_fault_key`."""
        if raw is None:
            return None
        fault_id, _, kind = _s(raw).partition(" ")
        return fault_id, kind

    async def note_slot_fault(
        self, cluster: str, node: str, gpu: int, fault_id: str, kind: str
    ) -> None:
        """Remember, for 10 minutes, the GPU fault that hit the member on a slot."""
        await self._r.set(self.slot_fault_key(cluster, node, gpu), f"{fault_id} {kind}", ex=600)

    async def slot_fault(self, cluster: str, node: str, gpu: int) -> tuple[str, str] | None:
        """The GPU fault on a slot in the last 10 minutes: (fault_id, kind)."""
        return self.parse_slot_fault(await self._r.get(self.slot_fault_key(cluster, node, gpu)))

    async def finish(self, job_id: str) -> None:
        """The job ended: no more faults for its members."""
        await self._r.set(self._k(job_id, "finished"), "1", ex=JOB_TTL_S)

    async def finished(self, job_id: str) -> bool:
        """Whether the job has finished."""
        return bool(await self._r.exists(self._k(job_id, "finished")))

    async def mark_exited(self, job_id: str, member_id: str) -> None:
        """A member's process exited (its heartbeats stopping is then no news)."""
        pipe = self._r.pipeline(transaction=False)
        pipe.sadd(self._k(job_id, "exited"), member_id)
        pipe.expire(self._k(job_id, "exited"), JOB_TTL_S)
        await pipe.execute()

    async def exit_context(self, job_id: str) -> ExitContext:
        """What judging a member's exit needs, in one round trip of reads only (this is on
        the path from a killed rank to its ``worker_lost``; with ``appendfsync always`` a
        write would also wait for Redis's fsync)."""
        pipe = self._r.pipeline(transaction=False)
        pipe.exists(self._k(job_id, "app_error"))
        pipe.exists(self._k(job_id, "finished"))
        pipe.hgetall(self._k(job_id, "gen"))
        pipe.hget(self._k(job_id, "meta"), "cluster")
        app_error, finished, gen, cluster = await pipe.execute()
        return ExitContext(
            app_error=bool(app_error),
            finished=bool(finished),
            ranks=_ranks(gen),
            cluster=_s(cluster) if cluster else "local",
        )

    async def exited(self, job_id: str, member_id: str) -> bool:
        """Whether the launcher reported the member's exit."""
        return bool(await self._r.sismember(self._k(job_id, "exited"), member_id))

    async def mark_app_error(self, job_id: str) -> None:
        """The user's code raised: the launcher kills the rest; those exits are not faults."""
        await self._r.set(self._k(job_id, "app_error"), "1", ex=JOB_TTL_S)

    async def app_error(self, job_id: str) -> bool:
        """Whether the job failed with an application error."""
        return bool(await self._r.exists(self._k(job_id, "app_error")))


class NodeRegistry:
    """Nodes seen in telemetry, their health, lemon score and a per-GPU summary."""

    def __init__(self, redis: aioredis.Redis, prefix: str, cfg: DetectorConfig) -> None:
        self._r = redis
        self._p = prefix
        self._cfg = cfg
        self._health_script = redis.register_script(_HEALTH_LUA)

    def nodes_key(self, cluster: str) -> str:
        """Hash node -> inventory JSON of one cluster."""
        return f"{self._p}:nodes:{cluster}"

    def health_key(self, cluster: str) -> str:
        """Hash node -> health of one cluster."""
        return f"{self._p}:health:{cluster}"

    def episodes_key(self, cluster: str, node: str) -> str:
        """Set of a node's episode keys (closed on node_return)."""
        return f"{self._p}:epnode:{cluster}:{node}"

    async def record_inventory(self, cluster: str, inventory: dict[str, dict[str, Any]]) -> None:
        """Write the per-node summaries of one cluster (called at most every few seconds)."""
        pipe = self._r.pipeline(transaction=False)
        pipe.sadd(f"{self._p}:clusters", cluster)
        pipe.hset(
            self.nodes_key(cluster),
            mapping={node: json.dumps(inv) for node, inv in inventory.items()},
        )
        await pipe.execute()

    async def clusters(self) -> list[str]:
        """Every cluster seen."""
        return sorted(_s(c) for c in await self._r.smembers(f"{self._p}:clusters"))

    async def find_cluster(self, node: str) -> str | None:
        """The cluster a node belongs to (node names are unique across clusters)."""
        for cluster in await self.clusters():
            if await self._r.hexists(self.nodes_key(cluster), node):
                return cluster
        return None

    async def inventory(self, cluster: str) -> dict[str, dict[str, Any]]:
        """Node -> last inventory summary."""
        raw = await self._r.hgetall(self.nodes_key(cluster))
        return {_s(k): json.loads(_s(v)) for k, v in raw.items()}

    async def health(self, cluster: str, node: str) -> NodeHealth:
        """A node's health (healthy if never changed)."""
        v = await self._r.hget(self.health_key(cluster), node)
        return NodeHealth(_s(v)) if v else NodeHealth.HEALTHY

    async def health_all(self, cluster: str) -> dict[str, NodeHealth]:
        """Node -> health, for nodes whose health was ever changed."""
        raw = await self._r.hgetall(self.health_key(cluster))
        return {_s(k): NodeHealth(_s(v)) for k, v in raw.items()}

    async def raise_health(
        self, cluster: str, node: str, health: NodeHealth
    ) -> tuple[str, NodeHealth, int, int]:
        """Worsen a node's health through the circuit breaker.

        Returns (``ok`` | ``unchanged`` | ``refused``, previous health, out-of-service
        nodes, total nodes) - the counts are filled in when the breaker was consulted.
        """
        res = await self._health_script(
            keys=[self.health_key(cluster), self.nodes_key(cluster)],
            args=[
                node,
                health.value,
                repr(self._cfg.breaker_max_share),
                self._cfg.breaker_min_nodes,
            ],
        )
        return _s(res[0]), NodeHealth(_s(res[1])), int(res[2]), int(res[3])

    async def set_health(self, cluster: str, node: str, health: NodeHealth) -> None:
        """Set a node's health unconditionally (an operator returned it)."""
        await self._r.hset(self.health_key(cluster), node, health.value)

    async def gpu_health(self, cluster: str, node: str) -> dict[int, dict[str, Any]]:
        """Per-GPU open faults of a node: gpu -> {health, faults: [kind...]}."""
        raw = await self._r.hgetall(f"{self._p}:gpuhealth:{cluster}:{node}")
        return {int(_s(k)): json.loads(_s(v)) for k, v in raw.items()}

    async def mark_gpu(
        self, cluster: str, node: str, gpu: int, health: NodeHealth, kind: str
    ) -> None:
        """Note a fault on one GPU of a node (shown by node_get)."""
        key = f"{self._p}:gpuhealth:{cluster}:{node}"
        cur = await self._r.hget(key, str(gpu))
        data: dict[str, Any] = json.loads(_s(cur)) if cur else {"health": "healthy", "faults": []}
        if HEALTH_RANK[health] > HEALTH_RANK[NodeHealth(str(data["health"]))]:
            data["health"] = health.value
        if kind not in data["faults"]:
            data["faults"].append(kind)
        await self._r.hset(key, str(gpu), json.dumps(data))

    async def clear_gpus(self, cluster: str, node: str) -> None:
        """Forget a node's per-GPU faults (returned to service)."""
        await self._r.delete(f"{self._p}:gpuhealth:{cluster}:{node}")

    async def add_lemon(self, cluster: str, node: str, weight: float, now: float) -> float:
        """Add one fault to a node's decayed lemon score; returns the new score."""
        key = f"{self._p}:lemon:{cluster}"
        raw = await self._r.hget(key, node)
        score, last = (0.0, now)
        if raw:
            data = json.loads(_s(raw))
            score, last = float(data["score"]), float(data["ts"])
        new = lemon_update(score, last, now, weight, self._cfg.lemon_half_life_s)
        await self._r.hset(key, node, json.dumps({"score": new, "ts": now}))
        return new

    async def lemon(self, cluster: str, node: str, now: float | None = None) -> float:
        """A node's lemon score, decayed to ``now``."""
        raw = await self._r.hget(f"{self._p}:lemon:{cluster}", node)
        if not raw:
            return 0.0
        data = json.loads(_s(raw))
        now = time.time() if now is None else now
        half = self._cfg.lemon_half_life_s
        score = float(data["score"]) * 0.5 ** (max(0.0, now - float(data["ts"])) / half)
        return float(score)

    @staticmethod
    def out_of_service(health: NodeHealth) -> bool:
        """Whether a node in this health counts against the circuit breaker."""
        return health in OUT_OF_SERVICE


class Membership:
    """Live detector replicas (a Redis sorted set of heartbeats) and who owns which key.

    Ownership is rendezvous hashing over the live replicas: every replica computes the same
    owner for a node or a job from the same membership, and a change of membership moves
    only the keys of the replica that came or went.
    """

    def __init__(
        self, redis: aioredis.Redis, prefix: str, replica_id: str, ttl_s: float = 3.0
    ) -> None:
        self._r = redis
        self._key = f"{prefix}:replicas"
        self.replica_id = replica_id
        self.ttl_s = ttl_s
        self.replicas: list[str] = [replica_id]
        self._owners: dict[str, str] = {}

    async def beat(self, now: float | None = None) -> bool:
        """Announce this replica and refresh the live set; True when the set changed."""
        now = time.time() if now is None else now
        pipe = self._r.pipeline(transaction=False)
        pipe.zadd(self._key, {self.replica_id: now})
        pipe.zremrangebyscore(self._key, "-inf", now - 10 * self.ttl_s)
        pipe.zrangebyscore(self._key, now - self.ttl_s, "+inf")
        res = await pipe.execute()
        live = sorted({_s(x) for x in res[2]} | {self.replica_id})
        changed = live != self.replicas
        if changed:
            self.replicas = live
            self._owners.clear()
        return changed

    async def leave(self) -> None:
        """Stop owning anything (clean shutdown)."""
        await self._r.zrem(self._key, self.replica_id)

    def owner(self, key: str) -> str:
        """The replica that owns ``key``."""
        got = self._owners.get(key)
        if got is not None:
            return got
        if len(self.replicas) == 1:
            best = self.replicas[0]
        else:
            data = key.encode()
            best = max(self.replicas, key=lambda r: zlib.crc32(data + b"|" + r.encode()))
        if len(self._owners) > 100_000:
            self._owners.clear()
        self._owners[key] = best
        return best


@dataclass
class JobActivity:
    """What the owner of a job has seen of its heartbeats."""

    job_id: str
    members: dict[str, MemberProgress] = field(default_factory=dict)
    rank_steps: dict[int, list[float]] = field(default_factory=dict)
    step_times: list[float] = field(default_factory=list)
    straggler: StragglerTracker = field(default_factory=StragglerTracker)
    last_straggler_check: float = 0.0
    last_beat: float = 0.0
    # Host launchers of a job across hosts: launcher id -> (its node, when last heard).
    launchers: dict[str, tuple[str, float]] = field(default_factory=dict)

    def record_step_time(self, rank: int, seconds: float, window: int) -> None:
        """Keep the last ``window`` step times per rank and 10x that for the job."""
        steps = self.rank_steps.setdefault(rank, [])
        steps.append(seconds)
        if len(steps) > window:
            del steps[: len(steps) - window]
        self.step_times.append(seconds)
        if len(self.step_times) > 10 * window:
            del self.step_times[: len(self.step_times) - 10 * window]


__all__ = [
    "EpisodeStore",
    "JobActivity",
    "JobDirectory",
    "Membership",
    "NodeRegistry",
    "SlotHolder",
]
