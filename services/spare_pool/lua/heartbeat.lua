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
