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
