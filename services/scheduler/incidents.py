"""Incidents in Redis: one per (fault, job, rank), duplicates folded into the open one.

Keys under ``tr:scheduler``: ``incident:<id>`` (the record), ``incidents`` and
``incidents:job:<job>`` (sorted by detection time), ``fault:<fault_id>:<job>:<rank>`` (which
incident a fault went to, so a redelivered fault is a no-op), ``open:<job>:<member>`` (the
open incident of a member, so a second fault on it folds in).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import redis.asyncio as aioredis

from torchrelay.contract import Incident, MigrationMode, Resolution

# Opens an incident only if neither this fault nor another open one already covers the
# member: one atomic step, so two deliveries racing cannot both open one.
_OPEN_SCRIPT = """
local by_fault = redis.call('GET', KEYS[1])
if by_fault then return {'fault', by_fault} end
local open = redis.call('GET', KEYS[2])
if open then
  redis.call('SET', KEYS[1], open)
  return {'folded', open}
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[1])
redis.call('SET', KEYS[3], ARGV[2])
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1])
redis.call('ZADD', KEYS[5], ARGV[3], ARGV[1])
redis.call('SADD', KEYS[6], ARGV[1])
return {'opened', ARGV[1]}
"""


_CHUNK = 256


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class IncidentStore:
    """The scheduler's incidents; each record holds the Incident plus its migration."""

    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self._r = redis
        self._p = prefix

    def _key(self, incident_id: str) -> str:
        return f"{self._p}:incident:{incident_id}"

    async def open(
        self, incident: Incident, member_id: str, extra: dict[str, Any]
    ) -> tuple[str, str]:
        """Open ``incident`` for ``member_id`` unless the fault or the member already has one.

        Returns:
            ("opened" | "folded" | "fault", incident_id): ``folded`` means another fault on
            the member went into its open incident; ``fault`` that this fault was seen.
        """
        assert incident.fault_id is not None
        record = {
            "incident": incident.model_dump(mode="json"),
            "member_id": member_id,
            "folded_faults": [],
            **extra,
        }
        outcome, incident_id = await self._r.eval(
            _OPEN_SCRIPT,
            6,
            f"{self._p}:fault:{incident.fault_id}:{incident.job_id}:{incident.rank}",
            f"{self._p}:open:{incident.job_id}:{member_id}",
            self._key(incident.incident_id),
            f"{self._p}:incidents",
            f"{self._p}:incidents:job:{incident.job_id}",
            self._open_on(incident.cluster, incident.node),
            incident.incident_id,
            json.dumps(record),
            str(incident.detected_at.timestamp() * 1000.0),
        )
        outcome, incident_id = _text(outcome), _text(incident_id)
        if outcome == "folded":
            await self._fold(incident_id, incident.fault_id, incident.fault_kind.value)
        return outcome, incident_id

    def _open_on(self, cluster: str, node: str) -> str:
        return f"{self._p}:open_on:{cluster}:{node}"

    async def open_for_member(self, job_id: str, member_id: str) -> str | None:
        """The open incident of a member (it may no longer hold a rank: it is leaving)."""
        raw = await self._r.get(f"{self._p}:open:{job_id}:{member_id}")
        return None if raw is None else _text(raw)

    async def open_on_slot(self, cluster: str, node: str, gpu: int | None) -> list[str]:
        """Open incidents about ranks on a node (one GPU of it, if ``gpu`` is given)."""
        found = []
        for raw in await self._r.smembers(self._open_on(cluster, node)):
            incident = await self.get(_text(raw))
            if incident is None or incident.resolution != Resolution.OPEN:
                continue
            if gpu is None or incident.gpu == gpu:
                found.append(incident.incident_id)
        return sorted(found)

    async def fold(
        self, incident_id: str, fault_id: str, kind: str, job_id: str, rank: int | None
    ) -> bool:
        """Fold another fault into an open incident; False if this fault was seen before."""
        key = f"{self._p}:fault:{fault_id}:{job_id}:{rank}"
        if not await self._r.set(key, incident_id, nx=True):
            return False
        await self._fold(incident_id, fault_id, kind)
        return True

    async def _fold(self, incident_id: str, fault_id: str, kind: str) -> None:
        record = await self.record(incident_id)
        if record is None:
            return
        if fault_id not in [f["fault_id"] for f in record["folded_faults"]]:
            record["folded_faults"].append({"fault_id": fault_id, "kind": kind})
            await self._r.set(self._key(incident_id), json.dumps(record))

    async def record(self, incident_id: str) -> dict[str, Any] | None:
        """The stored record (incident, member, mode, migration id, folded faults)."""
        raw = await self._r.get(self._key(incident_id))
        return None if raw is None else dict(json.loads(raw))

    async def get(self, incident_id: str) -> Incident | None:
        record = await self.record(incident_id)
        return None if record is None else Incident.model_validate(record["incident"])

    async def set_mode(self, incident_id: str, mode: MigrationMode) -> None:
        """Record that the incident's migration switched mode (escalated to immediate)."""
        record = await self.record(incident_id)
        if record is not None:
            record["mode"] = mode.value
            await self._r.set(self._key(incident_id), json.dumps(record))

    async def amend(self, incident_id: str, **fields: Any) -> Incident | None:
        """Add what is learnt after an incident closed (a restart's lost steps and time)."""
        record = await self.record(incident_id)
        if record is None:
            return None
        incident = Incident.model_validate(record["incident"]).model_copy(update=fields)
        record["incident"] = incident.model_dump(mode="json")
        await self._r.set(self._key(incident_id), json.dumps(record))
        return incident

    async def close(self, closed: Incident) -> bool:
        """Store the closed incident; False if it was already closed (nothing changes)."""
        record = await self.record(closed.incident_id)
        if record is None:
            return False
        current = Incident.model_validate(record["incident"])
        if current.resolution != Resolution.OPEN:
            return False
        record["incident"] = closed.model_dump(mode="json")
        pipe = self._r.pipeline(transaction=True)
        pipe.set(self._key(closed.incident_id), json.dumps(record))
        pipe.srem(self._open_on(closed.cluster, closed.node), closed.incident_id)
        member = record.get("member_id")
        if member:
            # Only drop the member's open pointer if it still points at this incident.
            pipe.eval(
                "if redis.call('GET', KEYS[1]) == ARGV[1] then "
                "return redis.call('DEL', KEYS[1]) end return 0",
                1,
                f"{self._p}:open:{closed.job_id}:{member}",
                closed.incident_id,
            )
        await pipe.execute()
        return True

    async def query(
        self,
        *,
        job_id: str | None = None,
        tenant: str | None = None,
        resolution: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        offset: int = 0,
        limit: int | None = None,
    ) -> tuple[list[Incident], bool]:
        """Incidents matching every given filter, newest detection first.

        Returns the ``limit`` matches after the first ``offset`` and whether more match.
        Reads in chunks and stops once the page is full, so a page costs what it shows
        (plus what the filters skip), not the size of the whole ledger.
        """
        key = f"{self._p}:incidents:job:{job_id}" if job_id else f"{self._p}:incidents"
        lo = "-inf" if since is None else str(since.timestamp() * 1000.0)
        hi = "+inf" if until is None else str(until.timestamp() * 1000.0)
        wanted = None if limit is None else offset + limit + 1
        matched: list[Incident] = []
        position = 0
        while wanted is None or len(matched) < wanted:
            ids = await self._r.zrevrangebyscore(key, hi, lo, start=position, num=_CHUNK)
            if not ids:
                break
            position += len(ids)
            raws = await self._r.mget([self._key(_text(x)) for x in ids])
            for raw in raws:
                if raw is None:
                    continue
                inc = Incident.model_validate(json.loads(raw)["incident"])
                if tenant is not None and inc.tenant != tenant:
                    continue
                if resolution is not None and inc.resolution.value != resolution:
                    continue
                matched.append(inc)
        end = len(matched) if limit is None else offset + limit
        return matched[offset:end], len(matched) > end
