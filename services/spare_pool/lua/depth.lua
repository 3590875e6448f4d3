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
