"""The rendezvous of a job across hosts: ``tr.rpc.scheduler.join_host``.

One launcher per host joins with the job's shape (``nnodes``, ``nproc_per_node``) and its
node rank, or none to be given the lowest free one (torchrun's conventions, with the control
plane as the rendezvous: no extra server). The first join fixes the shape; every later one
must agree. A second launcher on a host that joined, a node rank another host holds, and a
host that comes once every rank is taken (a late host) are refused with a message naming
the host and the rank. A retried join of the same launcher process (``instance``) gets the
answer it got before. Where the job is bound to a claim (its credential was minted), a join
must give the same claim.
"""

from __future__ import annotations

import json
from typing import Any

from torchrelay.auth import CredentialRefused, JobCredentialStore
from torchrelay.bus import Conflict
from torchrelay.contract import HostJoin, HostJoined
from torchrelay.service import ServiceContext

HOSTS_TTL_S = 7 * 24 * 3600

# KEYS[1] the job's hosts (hash: node rank -> {"node", "instance"}), KEYS[2] its shape.
# ARGV: nnodes, nproc_per_node, node rank or "", node, instance, ttl.
# Returns {"ok", rank} or {"err", message}.
_JOIN_LUA = """
local nnodes, nproc = ARGV[1], ARGV[2]
local want, node, instance, ttl = ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6])
local shape = redis.call('HGETALL', KEYS[2])
if #shape == 0 then
  redis.call('HSET', KEYS[2], 'nnodes', nnodes, 'nproc_per_node', nproc)
else
  local s = {}
  for i = 1, #shape, 2 do s[shape[i]] = shape[i + 1] end
  if s['nnodes'] ~= nnodes or s['nproc_per_node'] ~= nproc then
    return {'err', 'the job has --nnodes ' .. s['nnodes'] .. ' --nproc-per-node ' ..
      s['nproc_per_node'] .. '; this host said --nnodes ' .. nnodes ..
      ' --nproc-per-node ' .. nproc}
  end
end
local all = redis.call('HGETALL', KEYS[1])
local taken = {}
for i = 1, #all, 2 do
  local h = cjson.decode(all[i + 1])
  if h['instance'] == instance then return {'ok', all[i]} end
  if h['node'] == node then
    return {'err', 'host ' .. node .. ' already joined as node rank ' .. all[i] ..
      ' (one launcher per host)'}
  end
  taken[all[i]] = h['node']
end
local rank = want
if rank == '' then
  for r = 0, tonumber(nnodes) - 1 do
    if taken[tostring(r)] == nil then rank = tostring(r); break end
  end
  if rank == '' then
    return {'err', 'all ' .. nnodes .. ' hosts have joined; host ' .. node ..
      ' is late (a job does not grow)'}
  end
elseif tonumber(rank) >= tonumber(nnodes) then
  return {'err', '--node-rank ' .. rank .. ' is not below --nnodes ' .. nnodes}
elseif taken[rank] ~= nil then
  return {'err', 'node rank ' .. rank .. ' is held by host ' .. taken[rank]}
end
redis.call('HSET', KEYS[1], rank, cjson.encode({node = node, instance = instance}))
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
return {'ok', rank}
"""


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class HostRendezvous:
    """The hosts of each job under ``<prefix>:hosts:<job>`` (see the module's docstring)."""

    def __init__(self, redis: Any, prefix: str, credentials: JobCredentialStore) -> None:
        self._r = redis
        self._p = prefix
        self._creds = credentials

    def _keys(self, job_id: str) -> list[str]:
        return [f"{self._p}:hosts:{job_id}", f"{self._p}:hostshape:{job_id}"]

    async def join(self, req: HostJoin) -> HostJoined:
        """This host's node rank in the job.

        Raises:
            Conflict: the claim differs, the shape disagrees, or the host or rank is taken.
        """
        try:
            await self._creds.check_claim(req.job_id, req.claim)
        except CredentialRefused as exc:
            raise Conflict(str(exc), "claim") from exc
        if req.node_rank is not None and req.node_rank >= req.nnodes:
            raise Conflict(f"--node-rank {req.node_rank} is not below --nnodes {req.nnodes}")
        got = await self._r.eval(
            _JOIN_LUA,
            2,
            *self._keys(req.job_id),
            req.nnodes,
            req.nproc_per_node,
            "" if req.node_rank is None else req.node_rank,
            req.node,
            req.instance,
            HOSTS_TTL_S,
        )
        status, value = _text(got[0]), _text(got[1])
        if status != "ok":
            raise Conflict(f"job {req.job_id}: {value}", "node_rank")
        hosts = await self._r.hgetall(self._keys(req.job_id)[0])
        return HostJoined(
            job_id=req.job_id,
            node_rank=int(value),
            nnodes=req.nnodes,
            nproc_per_node=req.nproc_per_node,
            world_size=req.nnodes * req.nproc_per_node,
            hosts={_text(k): str(json.loads(_text(v))["node"]) for k, v in hosts.items()},
        )


async def setup_hosts(ctx: ServiceContext) -> None:
    """Serve ``join_host``."""
    hosts = HostRendezvous(ctx.redis, ctx.prefix, JobCredentialStore(ctx.redis, ctx.prefix))

    async def join_host(body: dict[str, Any]) -> HostJoined:
        req = HostJoin.model_validate(body)
        joined = await hosts.join(req)
        ctx.log.info(
            "host joined",
            extra={"job_id": req.job_id, "node": req.node, "node_rank": joined.node_rank},
        )
        return joined

    await ctx.serve("join_host", join_host)
