"""The spare inventory in Redis: slots, leases, exclusions, and every transition's history.

Every change of a slot's state runs inside one Lua script, so a reservation is atomic and a
slot can never be leased twice, however many executors and pool replicas race. Keys live
under the service's prefix (``tr:spare_pool``):

- ``:slot:<id>`` hash: the :class:`~torchrelay.contract.SpareSlot` fields, plus ``home``
  (the state it returns to: ``idle`` or ``hot``), ``lease_id``, ``lease_expires_ms``,
  ``prev_state``, ``reason``, ``updated_ms``, ``version``;
- ``:hist:<id>`` list: one JSON entry per transition (time, from, to, reason);
- ``:slots`` (all ids, lexicographic), ``:idle|<cluster>[|d|<domain>|r|<rack>|z|<zone>]``
  (idle slots, by locality), ``:hot|<job>``, ``:job|<job>``, ``:nodeslots|<cluster>|<node>``;
- ``:lease:<id>`` hash and ``:leases`` (active leases by expiry);
- ``:excl|<node>`` (the pool's quarantine of a node or GPU, remembered for later
  registrations), ``:health|<cluster>|<node>`` (the detector's unhealthy/lemon verdicts);
- ``:member|<member_id>`` and ``:hb`` (hot spares' heartbeat deadlines).

Time is Redis's own clock (``TIME``) unless a clock is injected (tests), so pool replicas on
different hosts agree on when a lease expires.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from torchrelay.bus import Conflict, NotFound
from torchrelay.contract import SpareSlot, SpareState, make_event_id

from .rules import (
    EXCLUDING_HEALTH,
    ReserveRequest,
    register_conflict,
)

HISTORY_MAX = 200
LEASE_TTL_MS = 24 * 3600 * 1000  # ended leases are remembered a day (idempotent replies)
HISTORY_TTL_MS = 7 * 24 * 3600 * 1000  # history of a slot that left the pool
LAPSED_KEEP_S = 7 * 24 * 3600  # a lapsed hot spare's registration, kept to re-admit it
SWEEP_LIMIT = 256

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- Lua

# Shared by every script. KEYS[1] is the prefix, ARGV[1] the time in ms (negative: ask
# Redis). Scripts build their keys from the prefix: this runs on one Redis primary, not a
# Redis Cluster (where keys would have to be declared and share a hash slot).
_LIB = r"""
local P = KEYS[1]
local NOW = tonumber(ARGV[1])
if (not NOW) or NOW < 0 then
  local t = redis.call('TIME')
  NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local HISTORY_MAX = @HISTORY_MAX@
local LEASE_TTL_MS = @LEASE_TTL_MS@
local HISTORY_TTL_MS = @HISTORY_TTL_MS@
local HB_GRACE_MS = @HB_GRACE_MS@

local function ms(x) return string.format('%.0f', x) end
local function slot_key(id) return P .. ':slot:' .. id end
local function lease_key(id) return P .. ':lease:' .. id end

local function hgetall(key)
  local raw = redis.call('HGETALL', key)
  if #raw == 0 then return nil end
  local h = {}
  for i = 1, #raw, 2 do h[raw[i]] = raw[i + 1] end
  return h
end

local function idle_keys(h)
  local base = P .. ':idle|' .. h.cluster
  return {base, base .. '|d|' .. h.nvlink_domain, base .. '|r|' .. h.rack,
          base .. '|z|' .. h.zone}
end

local OWNED = {hot = true, reserved = true, in_use = true}

local function unindex(h)
  for _, k in ipairs(idle_keys(h)) do redis.call('ZREM', k, h.slot_id) end
  if h.job_id ~= '' then
    redis.call('ZREM', P .. ':hot|' .. h.job_id, h.slot_id)
    redis.call('SREM', P .. ':job|' .. h.job_id, h.slot_id)
  end
end

local function index(h)
  if h.state == 'idle' then
    for _, k in ipairs(idle_keys(h)) do redis.call('ZADD', k, 0, h.slot_id) end
  end
  if h.job_id ~= '' and OWNED[h.state] then
    redis.call('SADD', P .. ':job|' .. h.job_id, h.slot_id)
    if h.state == 'hot' then redis.call('ZADD', P .. ':hot|' .. h.job_id, 0, h.slot_id) end
  end
end

local function save(h)
  h.version = tostring((tonumber(h.version) or 0) + 1)
  local args = {}
  for k, v in pairs(h) do
    args[#args + 1] = k
    args[#args + 1] = tostring(v)
  end
  redis.call('HSET', slot_key(h.slot_id), unpack(args))
end

local function record(id, from, to, reason, extra)
  local e = {at = NOW, from = from, to = to, reason = reason}
  if extra then for k, v in pairs(extra) do e[k] = v end end
  local key = P .. ':hist:' .. id
  redis.call('RPUSH', key, cjson.encode(e))
  redis.call('LTRIM', key, -HISTORY_MAX, -1)
end

local function transition(h, to, reason, changes, extra)
  local from = h.state
  unindex(h)
  if changes then for k, v in pairs(changes) do h[k] = v end end
  h.state = to
  h.reason = reason
  h.updated_ms = ms(NOW)
  index(h)
  save(h)
  record(h.slot_id, from, to, reason, extra)
end

local function exclusion(cluster, node, gpu)
  local g = tostring(gpu)
  local ex = redis.call('HMGET', P .. ':excl|' .. node, cluster .. '|' .. g, cluster .. '|*',
                        '*|' .. g, '*|*')
  for i = 1, 4 do if ex[i] then return cjson.decode(ex[i]) end end
  return nil
end

local function health(cluster, node, gpu)
  local hl = redis.call('HMGET', P .. ':health|' .. cluster .. '|' .. node, tostring(gpu), '*')
  for i = 1, 2 do if hl[i] then return hl[i] end end
  return nil
end

local function blocked(h)
  return exclusion(h.cluster, h.node, h.gpu) ~= nil or health(h.cluster, h.node, h.gpu) ~= nil
end

-- End a lease (released / expired / revoked). With restore, a slot still held by the lease
-- goes back to the state it had before (hot stays hot for its job); without, the caller
-- moves the slot itself.
local function end_lease(lid, outcome, reason, restore)
  local lk = lease_key(lid)
  local l = hgetall(lk)
  if (not l) or (l.state ~= 'active' and l.state ~= 'confirmed') then return nil end
  redis.call('ZREM', P .. ':leases', lid)
  redis.call('HSET', lk, 'state', outcome, 'ended_ms', ms(NOW), 'reason', reason)
  redis.call('PEXPIRE', lk, LEASE_TTL_MS)
  local h = hgetall(slot_key(l.slot_id))
  if restore and h and h.lease_id == lid and (h.state == 'reserved' or h.state == 'in_use') then
    local changes = {lease_id = '', lease_expires_ms = '', prev_state = ''}
    if l.prev_state ~= 'hot' then changes.job_id = '' end
    transition(h, l.prev_state, reason, changes, {lease_id = lid})
    if l.prev_state == 'hot' and h.member_id ~= '' then
      redis.call('ZADD', P .. ':hb', ms(NOW + HB_GRACE_MS), h.member_id)
    end
  end
  return {lease_id = lid, slot_id = l.slot_id, job_id = l.job_id, reason = reason,
          outcome = outcome}
end

local function expire_due(limit)
  local out = {}
  local due = redis.call('ZRANGEBYSCORE', P .. ':leases', '-inf', ms(NOW), 'LIMIT', 0, limit)
  for _, lid in ipairs(due) do
    local e = end_lease(lid, 'expired', 'lease expired before it was confirmed', true)
    if e then out[#out + 1] = e else redis.call('ZREM', P .. ':leases', lid) end
  end
  return out
end

-- The slot leaves the pool (its job finished, or its hot spare died); its history stays a
-- while.
local function remove_slot(h, reason)
  local ended = nil
  if h.lease_id ~= '' then ended = end_lease(h.lease_id, 'revoked', reason, false) end
  unindex(h)
  redis.call('DEL', slot_key(h.slot_id))
  redis.call('ZREM', P .. ':slots', h.slot_id)
  redis.call('SREM', P .. ':nodeslots|' .. h.cluster .. '|' .. h.node, h.slot_id)
  if h.member_id ~= '' then
    if redis.call('GET', P .. ':member|' .. h.member_id) == h.slot_id then
      redis.call('DEL', P .. ':member|' .. h.member_id)
    end
    redis.call('ZREM', P .. ':hb', h.member_id)
  end
  record(h.slot_id, h.state, 'removed', reason, nil)
  redis.call('PEXPIRE', P .. ':hist:' .. h.slot_id, HISTORY_TTL_MS)
  return ended
end

local function split1(s)
  local i = string.find(s, '|', 1, true)
  return string.sub(s, 1, i - 1), string.sub(s, i + 1)
end

local function node_clusters(cluster, node)
  if cluster ~= '' then return {cluster} end
  return redis.call('SMEMBERS', P .. ':nodeclusters|' .. node)
end
"""

_REGISTER = r"""
-- ARGV: now, slot json, expected version ('' = must not exist)
local s = cjson.decode(ARGV[2])
local expect = ARGV[3]
local id = s.slot_id
local h = hgetall(slot_key(id))
if ((h and h.version) or '') ~= expect then return cjson.encode({retry = true}) end
local from = 'new'
local old_member = ''
if h then
  from = h.state
  old_member = h.member_id
  unindex(h)
else
  h = {slot_id = id, state = '', lease_id = '', lease_expires_ms = '', prev_state = '',
       registered_ms = ms(NOW), version = '0'}
end
h.cluster = s.cluster
h.node = s.node
h.gpu = tostring(s.gpu)
h.gpu_model = s.gpu_model
h.memory_mb = tostring(s.memory_mb)
h.nvlink_domain = s.nvlink_domain
h.rack = s.rack
h.zone = s.zone
h.home = s.state
h.job_id = s.job_id
h.member_id = s.member_id
local to = s.state
local reason = 'registered'
local ex = exclusion(s.cluster, s.node, s.gpu)
if ex then
  to = ex.state
  reason = 'registered on an excluded node: ' .. ex.reason
elseif from == 'quarantined' or from == 'rma' or from == 'reserved' or from == 'in_use' then
  to = from
  reason = 're-registered while ' .. from
end
h.state = to
h.reason = reason
h.updated_ms = ms(NOW)
index(h)
save(h)
record(id, from, to, reason, {job_id = s.job_id, member_id = s.member_id})
redis.call('PERSIST', P .. ':hist:' .. id)
redis.call('ZADD', P .. ':slots', 0, id)
redis.call('SADD', P .. ':nodeslots|' .. s.cluster .. '|' .. s.node, id)
redis.call('SADD', P .. ':nodeclusters|' .. s.node, s.cluster)
redis.call('HSET', P .. ':node|' .. s.cluster .. '|' .. s.node, 'nvlink_domain',
           s.nvlink_domain, 'rack', s.rack, 'zone', s.zone)
redis.call('SADD', P .. ':domains', s.cluster .. '|' .. s.nvlink_domain)
if old_member ~= '' and old_member ~= h.member_id then
  if redis.call('GET', P .. ':member|' .. old_member) == id then
    redis.call('DEL', P .. ':member|' .. old_member)
  end
  redis.call('ZREM', P .. ':hb', old_member)
end
if to == 'hot' and h.member_id ~= '' then
  redis.call('SET', P .. ':member|' .. h.member_id, id)
  redis.call('ZADD', P .. ':hb', ms(NOW + HB_GRACE_MS), h.member_id)
end
return cjson.encode({slot = h, from = from})
"""

_RESERVE = r"""
-- ARGV: now, job, cluster, near_node, gpu_model, min_memory_mb, lease_ms, lease_id, limit
local job, cluster, near_node, model = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local minmem, lease_ms, lid = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8]
local expired = expire_due(tonumber(ARGV[9]))

local prior = hgetall(lease_key(lid))
if prior then
  if prior.state == 'active' or prior.state == 'confirmed' then
    return cjson.encode({lease_id = lid, slot = hgetall(slot_key(prior.slot_id)),
                         expires_ms = prior.expires_ms, tier = prior.tier, replayed = true,
                         expired = expired})
  end
  return cjson.encode({error = 'conflict', field = 'request_id', expired = expired,
                       message = 'the lease of this request_id already ended (' ..
                                 prior.state .. ': ' .. (prior.reason or '') ..
                                 '); reserve again with a new request_id'})
end

local near = nil
if near_node ~= '' then
  local t = redis.call('HMGET', P .. ':node|' .. cluster .. '|' .. near_node,
                       'nvlink_domain', 'rack', 'zone')
  if t[1] then near = {d = t[1], r = t[2], z = t[3]} end
end

local seen = {}
local counts = {considered = 0, gpu_model = 0, min_memory_mb = 0, excluded = 0}
local models = {}
local nmodels = 0

-- First fitting slot of a tier off near_node (the node that just failed), else the first
-- fitting one on it; ids come in lexicographic order, so the choice is deterministic.
local function scan(key, hot)
  local fallback = nil
  for _, id in ipairs(redis.call('ZRANGE', key, 0, -1)) do
    if not seen[id] then
      seen[id] = true
      local h = hgetall(slot_key(id))
      local candidate = h and ((hot and h.state == 'hot' and h.job_id == job and
                                h.cluster == cluster) or ((not hot) and h.state == 'idle'))
      if candidate then
        counts.considered = counts.considered + 1
        local why = nil
        if model ~= '' and h.gpu_model ~= model then why = 'gpu_model'
        elseif (tonumber(h.memory_mb) or 0) < minmem then why = 'min_memory_mb'
        elseif blocked(h) then why = 'excluded' end
        if why then
          counts[why] = counts[why] + 1
          if not models[h.gpu_model] then
            models[h.gpu_model] = true
            nmodels = nmodels + 1
          end
        elseif h.node ~= near_node then
          return h
        elseif not fallback then
          fallback = h
        end
      end
    end
  end
  return fallback
end

local base = P .. ':idle|' .. cluster
local tiers = {{'hot', P .. ':hot|' .. job}}
if near then
  tiers[#tiers + 1] = {'nvlink_domain', base .. '|d|' .. near.d}
  tiers[#tiers + 1] = {'rack', base .. '|r|' .. near.r}
  tiers[#tiers + 1] = {'zone', base .. '|z|' .. near.z}
end
tiers[#tiers + 1] = {'any', base}

local chosen, tier = nil, nil
for _, t in ipairs(tiers) do
  chosen = scan(t[2], t[1] == 'hot')
  if chosen then
    tier = t[1]
    break
  end
end

if not chosen then
  local names = {}
  for m, _ in pairs(models) do names[#names + 1] = m end
  table.sort(names)
  return cjson.encode({error = 'not_found', counts = counts, models = names,
                       near_known = near ~= nil, expired = expired})
end

local expires = NOW + lease_ms
local prev = chosen.state
transition(chosen, 'reserved', 'reserved for job ' .. job,
           {job_id = job, lease_id = lid, lease_expires_ms = ms(expires), prev_state = prev},
           {lease_id = lid, job_id = job})
redis.call('HSET', lease_key(lid), 'lease_id', lid, 'slot_id', chosen.slot_id, 'job_id', job,
           'cluster', cluster, 'state', 'active', 'prev_state', prev,
           'expires_ms', ms(expires), 'created_ms', ms(NOW), 'tier', tier)
redis.call('ZADD', P .. ':leases', ms(expires), lid)
return cjson.encode({lease_id = lid, slot = chosen, expires_ms = ms(expires), tier = tier,
                     near_known = near ~= nil, expired = expired})
"""

_CONFIRM = r"""
-- ARGV: now, lease_id
local lid = ARGV[2]
local l = hgetall(lease_key(lid))
if not l then
  return cjson.encode({error = 'not_found', field = 'lease_id',
                       message = 'no lease ' .. lid .. ': it never existed, or it ended ' ..
                                 'more than a day ago'})
end
if l.state == 'confirmed' then
  return cjson.encode({slot = hgetall(slot_key(l.slot_id)), replayed = true})
end
if l.state ~= 'active' then
  return cjson.encode({error = 'conflict', field = 'lease_id',
                       message = 'lease ' .. lid .. ' was ' .. l.state .. ' (' ..
                                 (l.reason or '') .. '); reserve another spare'})
end
if tonumber(l.expires_ms) <= NOW then
  local e = end_lease(lid, 'expired', 'lease expired before it was confirmed', true)
  return cjson.encode({error = 'conflict', field = 'lease_id', expired = {e},
                       message = 'lease ' .. lid .. ' expired before it was confirmed; ' ..
                                 'its spare went back to the pool, reserve again'})
end
local h = hgetall(slot_key(l.slot_id))
if (not h) or h.lease_id ~= lid or h.state ~= 'reserved' then
  return cjson.encode({error = 'conflict', field = 'lease_id',
                       message = 'the slot of lease ' .. lid .. ' is no longer held by it'})
end
transition(h, 'in_use', 'confirmed by job ' .. l.job_id, nil,
           {lease_id = lid, job_id = l.job_id})
redis.call('HSET', lease_key(lid), 'state', 'confirmed', 'confirmed_ms', ms(NOW))
redis.call('ZREM', P .. ':leases', lid)
if h.member_id ~= '' then redis.call('ZREM', P .. ':hb', h.member_id) end
return cjson.encode({slot = h})
"""

_RELEASE = r"""
-- ARGV: now, lease_id, reason
local lid, reason = ARGV[2], ARGV[3]
local l = hgetall(lease_key(lid))
if not l then
  return cjson.encode({error = 'not_found', field = 'lease_id',
                       message = 'no lease ' .. lid .. ': it never existed, or it ended ' ..
                                 'more than a day ago'})
end
local e = end_lease(lid, 'released', reason, true)
return cjson.encode({slot = hgetall(slot_key(l.slot_id)), ended = e, outcome = e and
                     'released' or l.state, slot_id = l.slot_id})
"""

_QUARANTINE = r"""
-- ARGV: now, cluster ('' = any), node, gpu ('' = all), state, reason
local cluster, node, gpu, state, reason = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local known = false
local slots, changed, revoked = {}, {}, {}
for _, c in ipairs(node_clusters(cluster, node)) do
  local ids = redis.call('SMEMBERS', P .. ':nodeslots|' .. c .. '|' .. node)
  if #ids > 0 or redis.call('EXISTS', P .. ':node|' .. c .. '|' .. node) == 1 then
    known = true
  end
  table.sort(ids)
  for _, id in ipairs(ids) do
    local h = hgetall(slot_key(id))
    if h and (gpu == '' or h.gpu == gpu) then
      if h.state ~= state then
        local changes = {lease_id = '', lease_expires_ms = '', prev_state = ''}
        if h.lease_id ~= '' then
          local e = end_lease(h.lease_id, 'revoked', 'slot quarantined: ' .. reason, false)
          if e then revoked[#revoked + 1] = e end
        end
        if h.member_id ~= '' then redis.call('ZREM', P .. ':hb', h.member_id) end
        transition(h, state, reason, changes, nil)
        changed[#changed + 1] = id
      end
      slots[#slots + 1] = h
    end
  end
end
local field = (cluster ~= '' and cluster or '*') .. '|' .. (gpu ~= '' and gpu or '*')
local prev = redis.call('HGET', P .. ':excl|' .. node, field)
local since = NOW
if prev then
  known = true
  local p = cjson.decode(prev)
  if p.state == state then since = p.since end
end
redis.call('HSET', P .. ':excl|' .. node, field,
           cjson.encode({state = state, reason = reason, since = since}))
return cjson.encode({known = known, slots = slots, changed = changed, revoked = revoked,
                     since = ms(since)})
"""

_RETURN = r"""
-- ARGV: now, cluster ('' = any), node, gpu ('' = all), reason
local cluster, node, gpu, reason = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local excl_key = P .. ':excl|' .. node
local fields = redis.call('HKEYS', excl_key)
local drop = {}
for _, f in ipairs(fields) do
  local c, g = split1(f)
  if cluster == '' or c == cluster or c == '*' then
    if gpu ~= '' and g == '*' then
      local ex = cjson.decode(redis.call('HGET', excl_key, f))
      return cjson.encode({error = 'conflict', field = 'gpu',
                           message = 'node ' .. node .. ' is quarantined as a whole (' ..
                                     ex.reason .. '); return the node, without gpu'})
    end
    if gpu == '' or g == gpu then drop[#drop + 1] = f end
  end
end
local known = #drop > 0
local returned = {}
for _, c in ipairs(node_clusters(cluster, node)) do
  local ids = redis.call('SMEMBERS', P .. ':nodeslots|' .. c .. '|' .. node)
  if #ids > 0 then known = true end
  table.sort(ids)
  for _, id in ipairs(ids) do
    local h = hgetall(slot_key(id))
    if h and (gpu == '' or h.gpu == gpu) and (h.state == 'quarantined' or h.state == 'rma') then
      if h.member_id ~= '' and redis.call('GET', P .. ':member|' .. h.member_id) == id then
        redis.call('DEL', P .. ':member|' .. h.member_id)
      end
      transition(h, 'idle', reason, {job_id = '', member_id = '', home = 'idle', lease_id = '',
                                     lease_expires_ms = '', prev_state = ''}, nil)
      returned[#returned + 1] = h
    end
  end
end
if not known then
  return cjson.encode({error = 'not_found', field = 'node',
                       message = 'node ' .. node .. ' has no slots in the spare inventory' ..
                                 (cluster ~= '' and (' of cluster ' .. cluster) or '') ..
                                 ' and is not quarantined; check the name'})
end
for _, f in ipairs(drop) do redis.call('HDEL', excl_key, f) end
return cjson.encode({returned = returned})
"""

_HEARTBEAT = r"""
-- ARGV: now, member_id, timeout_ms
local timeout = tonumber(ARGV[3])
local deadline = redis.call('ZSCORE', P .. ':hb', ARGV[2])
if not deadline then return '0' end
-- Beats come twice a second: write only when the deadline moves by a quarter of the timeout,
-- or when it is still the longer grace of a fresh registration.
local d = tonumber(deadline)
if d < NOW + timeout * 0.75 or d > NOW + timeout then
  redis.call('ZADD', P .. ':hb', ms(NOW + timeout), ARGV[2])
end
return '1'
"""

_SWEEP = r"""
-- ARGV: now, limit, how long a lapsed spare's registration is kept (ms)
local limit = tonumber(ARGV[2])
local keep_ms = tonumber(ARGV[3])
local expired = expire_due(limit)
local removed = {}
local old = redis.call('ZRANGEBYSCORE', P .. ':lapsed_at', '-inf', ms(NOW - keep_ms),
                       'LIMIT', 0, limit)
for _, m in ipairs(old) do
  redis.call('HDEL', P .. ':lapsed_reg', m)
  redis.call('ZREM', P .. ':lapsed_at', m)
end
local stale = redis.call('ZRANGEBYSCORE', P .. ':hb', '-inf', ms(NOW), 'LIMIT', 0, limit)
for _, m in ipairs(stale) do
  local id = redis.call('GET', P .. ':member|' .. m)
  local h = id and hgetall(slot_key(id))
  if h and h.member_id == m and (h.state == 'hot' or h.state == 'reserved') then
    local e = remove_slot(h, 'hot spare ' .. m .. ' stopped heartbeating')
    if e then expired[#expired + 1] = e end
    -- Its process may live on (starved, cut off): keep the registration, in the same
    -- step as the removal, so that its next beat can bring it back (service.py).
    redis.call('HSET', P .. ':lapsed_reg', m, cjson.encode(h))
    redis.call('ZADD', P .. ':lapsed_at', ms(NOW), m)
    removed[#removed + 1] = {slot_id = h.slot_id, job_id = h.job_id, member_id = m,
                             cluster = h.cluster, nvlink_domain = h.nvlink_domain}
  else
    redis.call('ZREM', P .. ':hb', m)
  end
end
return cjson.encode({expired = expired, removed = removed})
"""

_JOB_FINISHED = r"""
-- ARGV: now, job_id, reason
local job, reason = ARGV[2], ARGV[3]
local ended, removed, freed = {}, {}, {}
local ids = redis.call('SMEMBERS', P .. ':job|' .. job)
table.sort(ids)
for _, id in ipairs(ids) do
  local h = hgetall(slot_key(id))
  if h and h.job_id == job then
    if h.lease_id ~= '' then
      local e = end_lease(h.lease_id, 'released', reason, false)
      if e then ended[#ended + 1] = e end
    end
    if h.home == 'hot' then
      remove_slot(h, reason)
      removed[#removed + 1] = id
    else
      transition(h, 'idle', reason, {job_id = '', lease_id = '', lease_expires_ms = '',
                                     prev_state = ''}, nil)
      freed[#freed + 1] = id
    end
  end
end
redis.call('DEL', P .. ':job|' .. job, P .. ':hot|' .. job)
return cjson.encode({ended = ended, removed = removed, freed = freed})
"""

_DEPTH = r"""
-- ARGV: now, cluster ('' = all), domain ('' = all)
local cluster, domain = ARGV[2], ARGV[3]
local out = {}
local all = redis.call('SMEMBERS', P .. ':domains')
table.sort(all)
for _, cd in ipairs(all) do
  local c, d = split1(cd)
  if (cluster == '' or c == cluster) and (domain == '' or d == domain) then
    local n = 0
    for _, id in ipairs(redis.call('ZRANGE', P .. ':idle|' .. c .. '|d|' .. d, 0, -1)) do
      local t = redis.call('HMGET', slot_key(id), 'node', 'gpu')
      if t[1] and not blocked({cluster = c, node = t[1], gpu = t[2]}) then n = n + 1 end
    end
    out[#out + 1] = {c, d, n}
  end
end
return cjson.encode(out)
"""


# --------------------------------------------------------------------------- results


def _ms_to_dt(value: Any) -> datetime | None:
    if value in (None, "", b""):
        return None
    return datetime.fromtimestamp(int(float(value)) / 1000.0, UTC)


def _as_list(value: Any) -> list[Any]:
    # cjson encodes an empty Lua table as {}.
    return value if isinstance(value, list) else []


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _lapsed_view(raw: Any) -> SlotView | None:
    """A kept registration (the slot hash as JSON), or None when it cannot be read."""
    try:
        decoded = json.loads(raw)
        return SlotView.from_hash(decoded) if isinstance(decoded, dict) else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


@dataclass(frozen=True)
class SlotView:
    """A slot as stored: the contract's SpareSlot plus the pool's bookkeeping."""

    slot: SpareSlot
    home: str = "idle"
    lease_id: str | None = None
    lease_expires_at: datetime | None = None
    reason: str = ""
    updated_at: datetime | None = None

    @classmethod
    def from_hash(cls, raw: dict[Any, Any]) -> SlotView:
        """Build from a slot hash (bytes from redis-py, or str from a script's JSON)."""
        h = {_str(k): _str(v) for k, v in raw.items()}
        slot = SpareSlot(
            slot_id=h["slot_id"],
            cluster=h["cluster"],
            node=h["node"],
            gpu=int(h["gpu"]),
            gpu_model=h.get("gpu_model", ""),
            memory_mb=int(h.get("memory_mb") or 0),
            nvlink_domain=h.get("nvlink_domain", "default"),
            rack=h.get("rack", "default"),
            zone=h.get("zone", "default"),
            state=SpareState(h["state"]),
            job_id=h.get("job_id") or None,
            member_id=h.get("member_id") or None,
        )
        return cls(
            slot=slot,
            home=h.get("home") or "idle",
            lease_id=h.get("lease_id") or None,
            lease_expires_at=_ms_to_dt(h.get("lease_expires_ms")),
            reason=h.get("reason", ""),
            updated_at=_ms_to_dt(h.get("updated_ms")),
        )

    def to_json(self) -> dict[str, Any]:
        """The slot's fields (as SpareSlot) and the bookkeeping, for replies."""
        out = self.slot.model_dump(mode="json")
        out.update(
            home=self.home,
            lease_id=self.lease_id,
            lease_expires_at=self.lease_expires_at.isoformat() if self.lease_expires_at else None,
            reason=self.reason,
            updated_at=self.updated_at.isoformat() if self.updated_at else None,
        )
        return out


@dataclass(frozen=True)
class LeaseEnd:
    """A lease that ended (released, expired or revoked): one SpareReleased event."""

    lease_id: str
    slot_id: str
    job_id: str
    reason: str
    outcome: str

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> LeaseEnd:
        return cls(
            lease_id=raw["lease_id"],
            slot_id=raw["slot_id"],
            job_id=raw["job_id"],
            reason=raw["reason"],
            outcome=raw["outcome"],
        )


@dataclass(frozen=True)
class Lease:
    """A granted reservation: the slot is held until ``expires_at`` unless confirmed."""

    lease_id: str
    slot: SlotView
    expires_at: datetime
    tier: str
    job_id: str
    replayed: bool = False
    near_known: bool = False

    def to_json(self) -> dict[str, Any]:
        """The ``reserve`` reply."""
        return {
            "lease_id": self.lease_id,
            "slot": self.slot.to_json(),
            "expires_at": self.expires_at.isoformat(),
            "tier": self.tier,
            "job_id": self.job_id,
            "replayed": self.replayed,
            "near_node_known": self.near_known,
        }


@dataclass(frozen=True)
class ReserveOutcome:
    """What a reservation did: the lease (or why none fits) and leases it found expired."""

    lease: Lease | None
    expired: list[LeaseEnd]
    error: NotFound | Conflict | None = None


@dataclass(frozen=True)
class QuarantineOutcome:
    """The slots of a quarantined node or GPU, and what changed."""

    known: bool
    slots: list[SlotView]
    changed: list[str]
    revoked: list[LeaseEnd]
    since_ms: int


@dataclass(frozen=True)
class SweepOutcome:
    """Leases the sweep expired and hot spares it removed for lack of heartbeats."""

    expired: list[LeaseEnd]
    removed: list[dict[str, str]]


@dataclass(frozen=True)
class JobFinishedOutcome:
    """What a job's end did to its spares."""

    ended: list[LeaseEnd]
    removed: list[str]
    freed: list[str]


@dataclass(frozen=True)
class DomainDepth:
    """Idle spares on healthy nodes of one NVLink domain."""

    cluster: str
    nvlink_domain: str
    available: int


@dataclass
class _Scripts:
    register: AsyncScript
    reserve: AsyncScript
    confirm: AsyncScript
    release: AsyncScript
    quarantine: AsyncScript
    return_: AsyncScript
    heartbeat: AsyncScript
    sweep: AsyncScript
    job_finished: AsyncScript
    depth: AsyncScript
    extra: dict[str, AsyncScript] = field(default_factory=dict)


def no_fit_message(
    request: ReserveRequest, counts: dict[str, Any], models: Sequence[str]
) -> tuple[str, str | None]:
    """Why no spare fits a reservation, and the request field to blame (if one is)."""
    considered = int(counts.get("considered", 0))
    head = f"no spare fits job {request.job_id} in cluster {request.cluster}"
    if considered == 0:
        return (
            f"{head}: it has no idle spare (nor a hot spare of this job); register "
            "spares or wait for one to be released",
            "cluster",
        )
    parts = []
    wrong_model = int(counts.get("gpu_model", 0))
    small = int(counts.get("min_memory_mb", 0))
    excluded = int(counts.get("excluded", 0))
    if wrong_model:
        have = ", ".join(models) or "?"
        parts.append(
            f"{wrong_model} of another gpu_model than {request.gpu_model!r} (have: {have})"
        )
    if small:
        parts.append(f"{small} with less than min_memory_mb={request.min_memory_mb}")
    if excluded:
        parts.append(f"{excluded} on quarantined, unhealthy or lemon nodes")
    blame = None
    if wrong_model == considered:
        blame = "gpu_model"
    elif small == considered:
        blame = "min_memory_mb"
    return f"{head}: of {considered} candidate slots, " + "; ".join(parts), blame


class SpareInventory:
    """The spare pool's state in Redis; every transition is one atomic script.

    Args:
        redis: an asyncio Redis client.
        prefix: the key prefix (the service's ``ctx.prefix``).
        clock: seconds since the epoch; None uses Redis's clock (production).
        heartbeat_grace_s: how long a newly registered hot spare may go without a heartbeat.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str,
        *,
        clock: Callable[[], float] | None = None,
        heartbeat_grace_s: float = 60.0,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self._clock = clock
        lib = (
            _LIB.replace("@HISTORY_MAX@", str(HISTORY_MAX))
            .replace("@LEASE_TTL_MS@", str(LEASE_TTL_MS))
            .replace("@HISTORY_TTL_MS@", str(HISTORY_TTL_MS))
            .replace("@HB_GRACE_MS@", str(int(heartbeat_grace_s * 1000)))
        )

        def script(body: str) -> AsyncScript:
            return redis.register_script(lib + body)

        self._s = _Scripts(
            register=script(_REGISTER),
            reserve=script(_RESERVE),
            confirm=script(_CONFIRM),
            release=script(_RELEASE),
            quarantine=script(_QUARANTINE),
            return_=script(_RETURN),
            heartbeat=script(_HEARTBEAT),
            sweep=script(_SWEEP),
            job_finished=script(_JOB_FINISHED),
            depth=script(_DEPTH),
        )

    # ----------------------------------------------------------------- plumbing

    def _now_arg(self) -> str:
        return "-1" if self._clock is None else str(int(self._clock() * 1000))

    async def _run(self, script: AsyncScript, *args: str | int) -> Any:
        raw = await script(keys=[self.prefix], args=[self._now_arg(), *args])
        return json.loads(raw)

    @staticmethod
    def _raise(reply: dict[str, Any]) -> None:
        if reply.get("error") == "not_found":
            raise NotFound(reply["message"], reply.get("field"))
        if reply.get("error") == "conflict":
            raise Conflict(reply["message"], reply.get("field"))

    def key(self, *parts: str) -> str:
        """A key under this inventory's prefix."""
        return self.prefix + ":" + ":".join(parts)

    # ----------------------------------------------------------------- verbs

    async def get_slot(self, slot_id: str) -> SlotView | None:
        """The slot, or None if it is not (or no longer) in the pool."""
        raw = await self.redis.hgetall(self.key("slot", slot_id))
        return SlotView.from_hash(raw) if raw else None

    async def history(self, slot_id: str) -> list[dict[str, Any]]:
        """Every transition of a slot, oldest first (the last 200)."""
        raw = await self.redis.lrange(self.key("hist", slot_id), 0, -1)
        return [json.loads(item) for item in raw]

    async def register(self, slot: SpareSlot) -> tuple[SlotView, str]:
        """Add or update a slot; returns the stored slot and the state it came from.

        Raises:
            Conflict: the slot is a hot spare of another job, or leased, or in use.
        """
        payload = slot.model_dump(mode="json")
        payload["job_id"] = slot.job_id or ""
        payload["member_id"] = slot.member_id or ""
        # Optimistic: the rule runs here, the write only if nobody changed the slot since.
        for _ in range(20):
            raw = await self.redis.hgetall(self.key("slot", slot.slot_id))
            version = ""
            if raw:
                existing = SlotView.from_hash(raw)
                problem = register_conflict(existing.slot, slot)
                if problem:
                    raise Conflict(problem, "slot_id")
                version = _str(raw[b"version"])
            reply = await self._run(self._s.register, json.dumps(payload), version)
            if not reply.get("retry"):
                return SlotView.from_hash(reply["slot"]), str(reply["from"])
        raise Conflict(
            f"slot {slot.slot_id} kept changing while it was registered; retry", "slot_id"
        )

    async def reserve(self, request: ReserveRequest) -> ReserveOutcome:
        """Lease the best fitting spare (one atomic script); see ``rules.pick_spare``."""
        if request.request_id:
            lease_id = make_event_id("lease", request.job_id, request.request_id)
        else:
            lease_id = uuid.uuid4().hex
        reply = await self._run(
            self._s.reserve,
            request.job_id,
            request.cluster,
            request.near_node or "",
            request.gpu_model or "",
            request.min_memory_mb,
            int(request.lease_s * 1000),
            lease_id,
            SWEEP_LIMIT,
        )
        expired = [LeaseEnd.from_json(e) for e in _as_list(reply.get("expired"))]
        if reply.get("error") == "conflict":
            return ReserveOutcome(None, expired, Conflict(reply["message"], reply.get("field")))
        if reply.get("error") == "not_found":
            message, blame = no_fit_message(request, reply["counts"], _as_list(reply.get("models")))
            return ReserveOutcome(None, expired, NotFound(message, blame))
        expires = _ms_to_dt(reply["expires_ms"])
        assert expires is not None
        lease = Lease(
            lease_id=reply["lease_id"],
            slot=SlotView.from_hash(reply["slot"]),
            expires_at=expires,
            tier=reply["tier"],
            job_id=request.job_id,
            replayed=bool(reply.get("replayed")),
            near_known=bool(reply.get("near_known")),
        )
        return ReserveOutcome(lease, expired)

    async def confirm(
        self, lease_id: str
    ) -> tuple[SlotView | None, list[LeaseEnd], Exception | None]:
        """Turn a lease into a slot in use; an expired lease is refused (and ended)."""
        reply = await self._run(self._s.confirm, lease_id)
        expired = [LeaseEnd.from_json(e) for e in _as_list(reply.get("expired"))]
        if reply.get("error"):
            try:
                self._raise(reply)
            except (NotFound, Conflict) as exc:
                return None, expired, exc
        return SlotView.from_hash(reply["slot"]), expired, None

    async def release(
        self, lease_id: str, reason: str
    ) -> tuple[SlotView | None, LeaseEnd | None, str]:
        """Give a lease's slot back to its previous state; idempotent.

        Returns the slot (None if it left the pool), the ended lease (None if it had already
        ended) and the lease's outcome.

        Raises:
            NotFound: no such lease.
        """
        reply = await self._run(self._s.release, lease_id, reason)
        self._raise(reply)
        slot = reply.get("slot")
        ended = reply.get("ended")
        return (
            SlotView.from_hash(slot) if isinstance(slot, dict) and slot else None,
            LeaseEnd.from_json(ended) if isinstance(ended, dict) and ended else None,
            str(reply.get("outcome")),
        )

    async def list_slots(
        self,
        *,
        cluster: str | None = None,
        state: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> tuple[list[SlotView], str | None]:
        """One page of slots in slot_id order, filtered; the cursor is the last id returned."""
        items: list[SlotView] = []
        start = f"({cursor}" if cursor else "-"
        batch = max(limit, 200)
        while len(items) < limit:
            ids = await self.redis.zrangebylex(self.key("slots"), start, "+", 0, batch)
            if not ids:
                return items, None
            pipe = self.redis.pipeline(transaction=False)
            for slot_id in ids:
                pipe.hgetall(self.key("slot", _str(slot_id)))
            for slot_id, raw in zip(ids, await pipe.execute(), strict=True):
                start = f"({_str(slot_id)}"
                if not raw:
                    continue
                view = SlotView.from_hash(raw)
                if cluster and view.slot.cluster != cluster:
                    continue
                if state and view.slot.state.value != state:
                    continue
                items.append(view)
                if len(items) == limit:
                    more = await self.redis.zrangebylex(self.key("slots"), start, "+", 0, 1)
                    return items, (view.slot.slot_id if more else None)
            if len(ids) < batch:
                return items, None
        return items, None

    async def quarantine(
        self, node: str, *, gpu: int | None, cluster: str | None, reason: str, rma: bool
    ) -> QuarantineOutcome:
        """Move a node's (or one GPU's) slots to quarantined/rma and exclude it from now on.

        Leases on those slots are revoked. The exclusion is recorded even for a node the
        pool has never seen (``known`` is False then), so slots registered on it later start
        quarantined.
        """
        state = SpareState.RMA.value if rma else SpareState.QUARANTINED.value
        reply = await self._run(
            self._s.quarantine, cluster or "", node, "" if gpu is None else str(gpu), state, reason
        )
        return QuarantineOutcome(
            known=bool(reply["known"]),
            slots=[SlotView.from_hash(s) for s in _as_list(reply.get("slots"))],
            changed=[str(c) for c in _as_list(reply.get("changed"))],
            revoked=[LeaseEnd.from_json(e) for e in _as_list(reply.get("revoked"))],
            since_ms=int(reply["since"]),
        )

    async def return_to_service(
        self, node: str, *, gpu: int | None, cluster: str | None, reason: str
    ) -> list[SlotView]:
        """Quarantined/RMA slots of a node (or GPU) back to idle; the exclusion is lifted.

        Raises:
            NotFound: the pool knows no slot and no quarantine of that node.
            Conflict: one GPU was named but the whole node is quarantined.
        """
        reply = await self._run(
            self._s.return_, cluster or "", node, "" if gpu is None else str(gpu), reason
        )
        self._raise(reply)
        return [SlotView.from_hash(s) for s in _as_list(reply.get("returned"))]

    async def set_health(self, cluster: str, node: str, gpu: int | None, health: str) -> None:
        """Record the detector's verdict on a node (or GPU): excluded unless healthy/degraded."""
        key = self.key(f"health|{cluster}|{node}")
        field_ = "*" if gpu is None else str(gpu)
        if health in EXCLUDING_HEALTH:
            await self.redis.hset(key, field_, health)
        else:
            await self.redis.hdel(key, field_)

    async def exclusion_of(self, slot: SpareSlot) -> dict[str, str]:
        """Why a slot's node is kept out of reservations: ``{"quarantine": ..., "health": ...}``."""
        excl = await self.redis.hmget(
            self.key(f"excl|{slot.node}"),
            f"{slot.cluster}|{slot.gpu}",
            f"{slot.cluster}|*",
            f"*|{slot.gpu}",
            "*|*",
        )
        health = await self.redis.hmget(
            self.key(f"health|{slot.cluster}|{slot.node}"), str(slot.gpu), "*"
        )
        out: dict[str, str] = {}
        for raw in excl:
            if raw:
                out["quarantine"] = json.loads(raw)["reason"]
                break
        for raw in health:
            if raw:
                out["health"] = _str(raw)
                break
        return out

    async def heartbeat(self, member_id: str, timeout_s: float) -> bool:
        """A hot spare's heartbeat: push its deadline out. False if it is not tracked."""
        return bool(await self._run(self._s.heartbeat, member_id, int(timeout_s * 1000)))

    async def tracked_members(self) -> set[str]:
        """Members of hot spares whose heartbeats the pool watches."""
        return {_str(m) for m in await self.redis.zrange(self.key("hb"), 0, -1)}

    async def sweep(self) -> SweepOutcome:
        """Expire due leases and drop hot spares whose heartbeats stopped."""
        reply = await self._run(self._s.sweep, SWEEP_LIMIT, LAPSED_KEEP_S * 1000)
        return SweepOutcome(
            expired=[LeaseEnd.from_json(e) for e in _as_list(reply.get("expired"))],
            removed=[dict(r) for r in _as_list(reply.get("removed"))],
        )

    # A hot spare whose beats lapsed (its process starved for seconds under load, the
    # network cut) is removed by the sweep, but its process may well live on. The sweep
    # keeps the removed slot's registration (``lapsed_reg``, member -> the slot's fields, for
    # ``LAPSED_KEEP_S``) so that its next beat can bring it back instead of leaving the job
    # without its spare (``SparePool.on_heartbeat``).

    async def lapsed_members(self) -> set[str]:
        """The hot spares the sweep removed for lack of beats, still re-admissible."""
        return {_str(m) for m in await self.redis.hkeys(self.key("lapsed_reg"))}

    async def lapsed(self, member_id: str) -> SpareSlot | None:
        """A lapsed spare's kept registration (None: none is kept).

        The slot as it was registered: a hot spare of its job, whatever lease it held then
        (the sweep revoked it). A kept entry that cannot be read (edited or corrupted in
        Redis) is dropped, with a warning naming it: it could never be re-admitted.
        """
        raw = await self.redis.hget(self.key("lapsed_reg"), member_id)
        if raw is None:
            return None
        view = _lapsed_view(raw)
        if view is None:
            log.warning(
                "dropping the unreadable kept registration of lapsed spare %s: %r",
                member_id,
                raw[:200],
            )
            await self.forget_lapsed_member(member_id)
            return None
        return view.slot.model_copy(update={"state": SpareState.HOT})

    async def forget_lapsed_member(self, member_id: str) -> None:
        """A lapsed spare came back, or may no longer: its registration is not kept."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hdel(self.key("lapsed_reg"), member_id)
        pipe.zrem(self.key("lapsed_at"), member_id)
        await pipe.execute()

    async def forget_lapsed(self, job_id: str) -> list[str]:
        """The job ended: its lapsed spares are not to come back. Returns their members.

        Unreadable kept entries (see :meth:`lapsed`) are dropped too, not returned.
        """
        entries = await self.redis.hgetall(self.key("lapsed_reg"))
        gone: list[str] = []
        unreadable: list[str] = []
        for member, raw in entries.items():
            view = _lapsed_view(raw)
            if view is None:
                unreadable.append(_str(member))
            elif view.slot.job_id == job_id:
                gone.append(_str(member))
        if unreadable:
            log.warning("dropping unreadable kept registrations of lapsed spares %s", unreadable)
        if gone or unreadable:
            pipe = self.redis.pipeline(transaction=True)
            pipe.hdel(self.key("lapsed_reg"), *gone, *unreadable)
            pipe.zrem(self.key("lapsed_at"), *gone, *unreadable)
            await pipe.execute()
        return gone

    async def job_finished(self, job_id: str, reason: str) -> JobFinishedOutcome:
        """The job's hot spares leave the pool; idle slots it held go back to idle."""
        reply = await self._run(self._s.job_finished, job_id, reason)
        return JobFinishedOutcome(
            ended=[LeaseEnd.from_json(e) for e in _as_list(reply.get("ended"))],
            removed=[str(r) for r in _as_list(reply.get("removed"))],
            freed=[str(r) for r in _as_list(reply.get("freed"))],
        )

    async def depth(
        self, cluster: str | None = None, nvlink_domain: str | None = None
    ) -> list[DomainDepth]:
        """Idle spares on healthy, unquarantined nodes per (cluster, NVLink domain)."""
        reply = await self._run(self._s.depth, cluster or "", nvlink_domain or "")
        return [DomainDepth(str(c), str(d), int(n)) for c, d, n in _as_list(reply)]

    async def was_low(self, cluster: str, nvlink_domain: str) -> int | None:
        """When the domain's current low episode began (ms), or None if it is not low."""
        raw = await self.redis.hget(self.key("low"), f"{cluster}|{nvlink_domain}")
        return int(raw) if raw else None

    async def mark_low(self, cluster: str, nvlink_domain: str, since_ms: int) -> int:
        """Start a low episode unless one is open; returns the episode's start (ms)."""
        field_ = f"{cluster}|{nvlink_domain}"
        await self.redis.hsetnx(self.key("low"), field_, since_ms)
        raw = await self.redis.hget(self.key("low"), field_)
        return int(raw) if raw else since_ms

    async def clear_low(self, cluster: str, nvlink_domain: str) -> None:
        """The domain is back at or above its floor."""
        await self.redis.hdel(self.key("low"), f"{cluster}|{nvlink_domain}")

    async def audit(self) -> list[str]:
        """Consistency problems of the stored inventory (tests, and operators' debugging).

        Each slot must be in exactly one state, sit in exactly the indexes that state
        implies, and a leased slot must be held by exactly one active lease.
        """
        problems: list[str] = []
        ids = [_str(i) for i in await self.redis.zrange(self.key("slots"), 0, -1)]
        leased_by: dict[str, str] = {}
        for lid in await self.redis.zrange(self.key("leases"), 0, -1):
            lease = {
                _str(k): _str(v)
                for k, v in (await self.redis.hgetall(self.key("lease", _str(lid)))).items()
            }
            if lease.get("state") != "active":
                problems.append(
                    f"lease {_str(lid)} is indexed as active but is {lease.get('state')}"
                )
                continue
            if lease["slot_id"] in leased_by:
                problems.append(f"slot {lease['slot_id']} is held by two leases")
            leased_by[lease["slot_id"]] = _str(lid)
        states = {s.value for s in SpareState}
        for slot_id in ids:
            raw = await self.redis.hgetall(self.key("slot", slot_id))
            if not raw:
                problems.append(f"slot {slot_id} is indexed but has no record")
                continue
            view = SlotView.from_hash(raw)
            s = view.slot
            if s.state.value not in states:
                problems.append(f"slot {slot_id} has unknown state {s.state}")
            base = f"idle|{s.cluster}"
            idle_keys = [
                base,
                f"{base}|d|{s.nvlink_domain}",
                f"{base}|r|{s.rack}",
                f"{base}|z|{s.zone}",
            ]
            for k in idle_keys:
                member = await self.redis.zscore(self.key(k), slot_id) is not None
                if member != (s.state is SpareState.IDLE):
                    problems.append(
                        f"slot {slot_id} ({s.state.value}) "
                        f"{'is' if member else 'is not'} in index {k}"
                    )
            if s.job_id:
                hot = await self.redis.zscore(self.key(f"hot|{s.job_id}"), slot_id) is not None
                if hot != (s.state is SpareState.HOT):
                    problems.append(f"slot {slot_id} ({s.state.value}) hot-index mismatch")
            if (s.state is SpareState.RESERVED) != (slot_id in leased_by):
                problems.append(
                    f"slot {slot_id} is {s.state.value} but "
                    f"{'has' if slot_id in leased_by else 'has no'} active lease"
                )
            if slot_id in leased_by and view.lease_id != leased_by[slot_id]:
                problems.append(
                    f"slot {slot_id} names lease {view.lease_id}, held by {leased_by[slot_id]}"
                )
        return problems


__all__ = [
    "DomainDepth",
    "JobFinishedOutcome",
    "Lease",
    "LeaseEnd",
    "QuarantineOutcome",
    "ReserveOutcome",
    "SlotView",
    "SpareInventory",
    "SweepOutcome",
    "no_fit_message",
]
