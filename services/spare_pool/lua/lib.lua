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
