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
