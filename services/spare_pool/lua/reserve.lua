-- ARGV: now, job, cluster, near_node, gpu_model, min_memory_mb, lease_ms, lease_id, limit
local job, cluster, near_node, model = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local minmem, lease_ms, lid = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8]
local expired = expire_due(tonumber(ARGV[9]))

local prior = hgetall(lease_key(lid))
if prior then
  if prior.state == 'active' or prior.state == 'confirmed' then
    return cjson.encode({lease_id = lid, slot = hgetall(slot_key(prior.slot_id)),
                         expires_ms = prior.expires_ms, tier = prior.tier, replayed = true,
                         expired = expired})
  end
  return cjson.encode({error = 'conflict', field = 'request_id', expired = expired,
                       message = 'the lease of this request_id already ended (' ..
                                 prior.state .. ': ' .. (prior.reason or '') ..
                                 '); reserve again with a new request_id'})
end

local near = nil
if near_node ~= '' then
  local t = redis.call('HMGET', P .. ':node|' .. cluster .. '|' .. near_node,
                       'nvlink_domain', 'rack', 'zone')
  if t[1] then near = {d = t[1], r = t[2], z = t[3]} end
end

local seen = {}
local counts = {considered = 0, gpu_model = 0, min_memory_mb = 0, excluded = 0}
local models = {}
local nmodels = 0

-- First fitting slot of a tier off near_node (the node that just failed), else the first
-- fitting one on it; ids come in lexicographic order, so the choice is deterministic.
local function scan(key, hot)
  local fallback = nil
  for _, id in ipairs(redis.call('ZRANGE', key, 0, -1)) do
    if not seen[id] then
      seen[id] = true
      local h = hgetall(slot_key(id))
      local candidate = h and ((hot and h.state == 'hot' and h.job_id == job and
                                h.cluster == cluster) or ((not hot) and h.state == 'idle'))
      if candidate then
        counts.considered = counts.considered + 1
        local why = nil
        if model ~= '' and h.gpu_model ~= model then why = 'gpu_model'
        elseif (tonumber(h.memory_mb) or 0) < minmem then why = 'min_memory_mb'
        elseif blocked(h) then why = 'excluded' end
        if why then
          counts[why] = counts[why] + 1
          if not models[h.gpu_model] then
            models[h.gpu_model] = true
            nmodels = nmodels + 1
          end
        elseif h.node ~= near_node then
          return h
        elseif not fallback then
          fallback = h
        end
      end
    end
  end
  return fallback
end

local base = P .. ':idle|' .. cluster
local tiers = {{'hot', P .. ':hot|' .. job}}
if near then
  tiers[#tiers + 1] = {'nvlink_domain', base .. '|d|' .. near.d}
  tiers[#tiers + 1] = {'rack', base .. '|r|' .. near.r}
  tiers[#tiers + 1] = {'zone', base .. '|z|' .. near.z}
end
tiers[#tiers + 1] = {'any', base}

local chosen, tier = nil, nil
for _, t in ipairs(tiers) do
  chosen = scan(t[2], t[1] == 'hot')
  if chosen then
    tier = t[1]
    break
  end
end

if not chosen then
  local names = {}
  for m, _ in pairs(models) do names[#names + 1] = m end
  table.sort(names)
  return cjson.encode({error = 'not_found', counts = counts, models = names,
                       near_known = near ~= nil, expired = expired})
end

local expires = NOW + lease_ms
local prev = chosen.state
transition(chosen, 'reserved', 'reserved for job ' .. job,
           {job_id = job, lease_id = lid, lease_expires_ms = ms(expires), prev_state = prev},
           {lease_id = lid, job_id = job})
redis.call('HSET', lease_key(lid), 'lease_id', lid, 'slot_id', chosen.slot_id, 'job_id', job,
           'cluster', cluster, 'state', 'active', 'prev_state', prev,
           'expires_ms', ms(expires), 'created_ms', ms(NOW), 'tier', tier)
redis.call('ZADD', P .. ':leases', ms(expires), lid)
return cjson.encode({lease_id = lid, slot = chosen, expires_ms = ms(expires), tier = tier,
                     near_known = near ~= nil, expired = expired})
