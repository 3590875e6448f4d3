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
