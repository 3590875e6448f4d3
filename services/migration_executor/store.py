"""The executor's Redis state under ``tr:migration_executor``: sagas, jobs, agent reports.

``saga:<id>`` holds a saga's state (written before the action its phase names);
``sagas:active`` the sagas not yet done, ``sagas:job:<job>`` a job's sagas, ``sagas`` all of
them by start time; ``jobs:<job>`` the job's registration; ``joined:<job>`` the JOINED
reports (member -> report) and ``resumed:<job>:<g>`` the RESUMED reports of generation g;
``awaited:<job>:<g>`` how many members a saga waits to see resume in generation g (written
with the saga that names g); ``joblock:<job>`` the one saga that may change the job's
generation now.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import redis.asyncio as aioredis

from torchrelay.contract import AgentReport, JobRegistered, JobRestarted, MigrationRequested, Role

from .saga import SagaState

_CREATE_SCRIPT = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX') == false then return 0 end
redis.call('SADD', KEYS[2], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[2])
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[2])
redis.call('SET', KEYS[5], ARGV[4])
redis.call('SET', KEYS[6], ARGV[2], 'NX')
return 1
"""


# A generation's RESUMED reports, but only once at least ARGV[1] are in: a saga polled while
# its ranks are still resuming reads one number, not the reports of a big job's every rank.
_RESUMED_SCRIPT = """
local n = redis.call('HLEN', KEYS[1])
if n < tonumber(ARGV[1]) then return n end
return redis.call('HGETALL', KEYS[1])
"""


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class Flags(NamedTuple):
    """What a saga's every step checks first."""

    escalation: bool  # the scheduler made this boundary migration immediate
    job_finished: bool


AWAITED_TTL_S = 7 * 24 * 3600  # outlives any saga; a finished job's expire sooner


class ResumedSoFar(NamedTuple):
    """What :meth:`ExecutorStore.add_resumed` learnt with the report it stored."""

    reported: int  # members whose RESUMED for the report's generation is stored
    awaited: int | None  # how many a saga waits for in that generation (None: no saga said)
    job_finished: bool


class Created(NamedTuple):
    """What :meth:`ExecutorStore.create` did."""

    created: bool  # False: the migration already had a saga (a redelivered request)
    flags: Flags  # read right after


class ExecutorStore:
    """Persistence of the executor's sagas and of what it learnt from the agents."""

    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self._r = redis
        self._p = prefix

    # ------------------------------------------------------------------ sagas

    async def create(self, state: SagaState, request: MigrationRequested) -> Created:
        """Store a new saga, unless the migration already has one (a redelivery).

        One script: the saga, its indexes, the request it came from and, if no other
        migration holds it, the job's lock, in one atomic step (and one AOF write). The
        saga's :meth:`step_flags` are read in the same round trip, after the script.
        """
        pipe = self._r.pipeline(transaction=False)
        pipe.eval(
            _CREATE_SCRIPT,
            6,
            f"{self._p}:saga:{state.migration_id}",
            f"{self._p}:sagas:active",
            f"{self._p}:sagas:job:{state.job_id}",
            f"{self._p}:sagas",
            f"{self._p}:request:{state.migration_id}",
            f"{self._p}:joblock:{state.job_id}",
            state.model_dump_json(),
            state.migration_id,
            str(state.created_at.timestamp()),
            request.model_dump_json(),
        )
        self._queue_flags(pipe, state.migration_id, state.job_id)
        created, escalation, finished = await pipe.execute()
        return Created(created=bool(created), flags=Flags(bool(escalation), bool(finished)))

    async def save(self, state: SagaState) -> Flags:
        """Persist a saga's new state (before the runner acts on it).

        Returns the saga's :meth:`step_flags` as they are right after the write, read in
        the same round trip: the runner's next step needs them.
        """
        pipe = self._r.pipeline(transaction=False)
        pipe.set(f"{self._p}:saga:{state.migration_id}", state.model_dump_json())
        if state.generation_after is not None and state.members_after:
            # Lets a RESUMED report tell whether it is the one the saga waits for.
            awaited = f"{self._p}:awaited:{state.job_id}:{state.generation_after}"
            pipe.set(awaited, len(state.members_after), ex=AWAITED_TTL_S)
            pipe.sadd(self._report_keys(state.job_id), awaited)
        self._queue_flags(pipe, state.migration_id, state.job_id)
        *_, escalation, finished = await pipe.execute()
        return Flags(bool(escalation), bool(finished))

    async def load(self, migration_id: str) -> SagaState | None:
        raw = await self._r.get(f"{self._p}:saga:{migration_id}")
        return None if raw is None else SagaState.model_validate_json(raw)

    async def finish(self, state: SagaState) -> None:
        """A done saga leaves the active set and hands the job lock back."""
        await self.unlock_job(state.job_id, state.migration_id)
        await self._r.srem(f"{self._p}:sagas:active", state.migration_id)

    async def active(self) -> list[str]:
        return sorted(_text(x) for x in await self._r.smembers(f"{self._p}:sagas:active"))

    async def of_job(self, job_id: str) -> list[str]:
        return sorted(_text(x) for x in await self._r.smembers(f"{self._p}:sagas:job:{job_id}"))

    async def all_ids(self) -> list[str]:
        """Every saga id, newest first."""
        return [_text(x) for x in await self._r.zrevrange(f"{self._p}:sagas", 0, -1)]

    async def lock_job(self, job_id: str, migration_id: str) -> bool:
        """Take the job's migration lock (re-entrant for the saga holding it)."""
        # One round trip: the saga usually holds it already (``create`` took it).
        taken = await self._r.eval(
            "local h = redis.call('GET', KEYS[1]) "
            "if not h then redis.call('SET', KEYS[1], ARGV[1]) return 1 end "
            "if h == ARGV[1] then return 1 end return 0",
            1,
            f"{self._p}:joblock:{job_id}",
            migration_id,
        )
        return bool(taken)

    async def take_job_lock(self, job_id: str, migration_id: str, from_holder: str) -> bool:
        """Take the job's lock from ``from_holder`` (only if it still holds it)."""
        taken = await self._r.eval(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then "
            "redis.call('SET', KEYS[1], ARGV[2]) return 1 end return 0",
            1,
            f"{self._p}:joblock:{job_id}",
            from_holder,
            migration_id,
        )
        return bool(taken)

    async def unlock_job(self, job_id: str, migration_id: str) -> None:
        await self._r.eval(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then "
            "return redis.call('DEL', KEYS[1]) end return 0",
            1,
            f"{self._p}:joblock:{job_id}",
            migration_id,
        )

    async def job_lock_holder(self, job_id: str) -> str | None:
        raw = await self._r.get(f"{self._p}:joblock:{job_id}")
        return None if raw is None else _text(raw)

    async def request_escalation(self, migration_id: str) -> None:
        """Ask the runner (the saga's only writer) to switch the migration to immediate."""
        await self._r.set(f"{self._p}:escalate:{migration_id}", "1", ex=86400)

    async def escalation_requested(self, migration_id: str) -> bool:
        return bool(await self._r.exists(f"{self._p}:escalate:{migration_id}"))

    async def step_flags(self, migration_id: str, job_id: str) -> Flags:
        """(escalation requested, job finished), read in one round trip per saga step
        (or with the write of the step before: :meth:`save`, :meth:`create`)."""
        pipe = self._r.pipeline(transaction=False)
        self._queue_flags(pipe, migration_id, job_id)
        escalation, finished = await pipe.execute()
        return Flags(bool(escalation), bool(finished))

    def _queue_flags(self, pipe: Any, migration_id: str, job_id: str) -> None:
        pipe.exists(f"{self._p}:escalate:{migration_id}")
        pipe.exists(f"{self._p}:finished:{job_id}")

    async def escalation_done(self, migration_id: str) -> None:
        await self._r.delete(f"{self._p}:escalate:{migration_id}")

    async def once(self, marker: str) -> bool:
        """True the first time ``marker`` is asked for (kept a day)."""
        return bool(await self._r.set(f"{self._p}:once:{marker}", "1", nx=True, ex=86400))

    # ------------------------------------------------------------------ jobs

    async def put_job(self, job: JobRegistered) -> None:
        await self._r.set(f"{self._p}:jobs:{job.job_id}", job.model_dump_json())

    async def job(self, job_id: str) -> JobRegistered | None:
        raw = await self._r.get(f"{self._p}:jobs:{job_id}")
        return None if raw is None else JobRegistered.model_validate_json(raw)

    async def put_restart(self, restart: JobRestarted) -> None:
        """The job's newest restart (an older one redelivered changes nothing)."""
        current = await self.restart(restart.job_id)
        if current is None or restart.restart > current.restart:
            await self._r.set(f"{self._p}:restart:{restart.job_id}", restart.model_dump_json())

    async def restart(self, job_id: str) -> JobRestarted | None:
        raw = await self._r.get(f"{self._p}:restart:{job_id}")
        return None if raw is None else JobRestarted.model_validate_json(raw)

    async def put_state_lost(self, job_id: str, generation: int, why: str) -> None:
        """A generation's ranks found no copy of some rank's state (kept a day)."""
        await self._r.set(f"{self._p}:state_lost:{job_id}:{generation}", why, ex=86400)

    async def state_lost(self, job_id: str, generation: int) -> str | None:
        raw = await self._r.get(f"{self._p}:state_lost:{job_id}:{generation}")
        return None if raw is None else _text(raw)

    async def mark_finished(self, job_id: str, outcome: str, seq: int = 0) -> None:
        """The job ended; ``seq`` is its JobFinished's position in the events stream."""
        pipe = self._r.pipeline(transaction=True)
        pipe.set(f"{self._p}:finished_seq:{job_id}", seq)
        pipe.set(f"{self._p}:finished:{job_id}", outcome)
        await pipe.execute()

    async def finished_seq(self, job_id: str) -> int:
        """The events-stream position of the job's JobFinished (0: not known)."""
        raw = await self._r.get(f"{self._p}:finished_seq:{job_id}")
        return int(raw) if raw else 0

    async def finished(self, job_id: str) -> bool:
        return bool(await self._r.exists(f"{self._p}:finished:{job_id}"))

    async def forget_reports(self, job_id: str, after_s: int = 3600) -> None:
        """Let a finished job's agent reports expire (sagas no longer need them)."""
        index = self._report_keys(job_id)
        keys = [f"{self._p}:joined:{job_id}", f"{self._p}:joined_workers:{job_id}", index]
        keys += [_text(key) for key in await self._r.smembers(index)]
        pipe = self._r.pipeline(transaction=False)
        for key in keys:
            pipe.expire(key, after_s)
        await pipe.execute()

    def _report_keys(self, job_id: str) -> str:
        """The set of a job's per-generation report keys (no SCAN: the executor's Redis user
        may not list keys)."""
        return f"{self._p}:reportkeys:{job_id}"

    async def mark_running(self, job_id: str) -> None:
        await self._r.set(f"{self._p}:running:{job_id}", "1")

    # ------------------------------------------------------------------ reports

    async def add_joined(self, report: AgentReport) -> None:
        pipe = self._r.pipeline(transaction=True)
        pipe.hset(f"{self._p}:joined:{report.job_id}", report.member_id, report.model_dump_json())
        if report.role == Role.WORKER:
            pipe.sadd(f"{self._p}:joined_workers:{report.job_id}", report.member_id)
        await pipe.execute()

    async def store_addrs(self, job_id: str, members: list[str]) -> dict[str, str]:
        """The rendezvous store addresses the given members announced when they joined."""
        if not members:
            return {}
        raws = await self._r.hmget(f"{self._p}:joined:{job_id}", members)
        out: dict[str, str] = {}
        for member, raw in zip(members, raws, strict=True):
            if raw is not None:
                addr = AgentReport.model_validate_json(raw).store_addr
                if addr:
                    out[member] = addr
        return out

    async def workers_joined(self, job_id: str) -> int:
        """How many workers of the job have joined (cheap: formation asks on every JOINED)."""
        return int(await self._r.scard(f"{self._p}:joined_workers:{job_id}"))

    async def joined(self, job_id: str) -> dict[str, AgentReport]:
        raw = await self._r.hgetall(f"{self._p}:joined:{job_id}")
        return {_text(k): AgentReport.model_validate_json(v) for k, v in raw.items()}

    async def has_joined(self, job_id: str, member_id: str) -> bool:
        return bool(await self._r.hexists(f"{self._p}:joined:{job_id}", member_id))

    async def add_resumed(self, report: AgentReport) -> ResumedSoFar:
        """Store a RESUMED report; with it, in the same round trip, how far its generation is.

        A saga waiting for a generation's members to resume needs only the last report of
        them: the caller skips driving it for the others (for a job of N ranks, N saga
        passes that each read up to N reports).
        """
        key = f"{self._p}:resumed:{report.job_id}:{report.generation}"
        body = {
            "rank": report.rank,
            "step": report.step,
            "stall_ms": report.stall_ms,
            "lost_steps": report.lost_steps,
            "bytes_received": report.bytes_received,
        }
        pipe = self._r.pipeline(transaction=False)
        pipe.hset(key, report.member_id, json.dumps(body))
        pipe.hlen(key)
        pipe.get(f"{self._p}:awaited:{report.job_id}:{report.generation}")
        pipe.exists(f"{self._p}:finished:{report.job_id}")
        pipe.sadd(self._report_keys(report.job_id), key)
        _, count, awaited, finished, _ = await pipe.execute()
        return ResumedSoFar(
            reported=int(count),
            awaited=int(awaited) if awaited is not None else None,
            job_finished=bool(finished),
        )

    async def resumed(
        self, job_id: str, generation: int, at_least: int = 0
    ) -> dict[str, dict[str, Any]] | None:
        """The RESUMED reports of a generation (member -> figures); None if fewer than
        ``at_least`` members reported (then only their number was read)."""
        raw = await self._r.eval(
            _RESUMED_SCRIPT, 1, f"{self._p}:resumed:{job_id}:{generation}", at_least
        )
        if isinstance(raw, int):
            return None
        pairs = iter(raw)
        return {_text(k): dict(json.loads(v)) for k, v in zip(pairs, pairs, strict=True)}
