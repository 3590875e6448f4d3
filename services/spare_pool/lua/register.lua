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
