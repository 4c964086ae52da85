-- claim: a worker marks the requests its batch still owns as claimed and renews their leases; with a
-- results db, also says which of them already have a stored result (a rerun after recovery); and
-- counts the batch messages queued behind this one.
-- KEYS[1] lease ZSET, KEYS[2] owner HASH, KEYS[3] claimed HASH,
-- then, with a results db, KEYS[3 + i] the result key of the i-th id,
-- then the batch queue LISTs to count (none: the count is 0).
-- ARGV[1] batch id, ARGV[2] lease ms, ARGV[3] results db ('' = do not look for results),
-- ARGV[4..] request ids.
-- Returns per id: 0 = not this batch's, 1 = claimed, 2 = claimed but answered already; then one
-- more element, the number of messages on the batch queue lists.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local batch = ARGV[1]
local expiry = now + tonumber(ARGV[2])
local out = {}
for i = 4, #ARGV do
  local id = ARGV[i]
  if redis.call('HGET', KEYS[2], id) == batch and redis.call('ZSCORE', KEYS[1], id) then
    redis.call('HSET', KEYS[3], id, batch)
    redis.call('ZADD', KEYS[1], 'XX', expiry, id)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
local ids = #ARGV - 3
local first_list = 4
if ARGV[3] ~= '' then first_list = 4 + ids end
local queued = 0
for k = first_list, #KEYS do
  queued = queued + redis.call('LLEN', KEYS[k])
end
if ARGV[3] ~= '' then
  -- SELECT in a script switches only the script's database, never the caller's (Redis >= 2.8.12).
  redis.call('SELECT', ARGV[3])
  for i = 1, #out do
    if out[i] == 1 and redis.call('EXISTS', KEYS[3 + i]) == 1 then out[i] = 2 end
  end
end
out[#out + 1] = queued
return out
