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
