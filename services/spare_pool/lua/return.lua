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
