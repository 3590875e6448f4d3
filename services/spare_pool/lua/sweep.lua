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
