-- requeue: put requests back at the front of the list each was taken from (its recorded origin, else
-- the base request list), verbatim, and forget them in every in-flight key. Given ids, those (a
-- coordinator's shutdown); given none, every request whose lease has run out (its holder died), up
-- to a limit.
-- KEYS[1] lease ZSET, KEYS[2] raw HASH, KEYS[3] owner HASH, KEYS[4] claimed HASH, KEYS[5] origin HASH,
-- KEYS[6] the base request list, KEYS[7..] the other request lists (an origin not among them counts
-- as the base list).
-- ARGV[1] max expired requests, ARGV[2..] request ids (none = the expired ones).
-- Returns how many requests were put back.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local lists = {}
for i = 7, #KEYS do lists[KEYS[i]] = true end
local ids
if #ARGV > 1 then
  ids = {}
  for i = 2, #ARGV do ids[#ids + 1] = ARGV[i] end
else
  ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
end
local n = 0
for _, id in ipairs(ids) do
  local raw = redis.call('HGET', KEYS[2], id)
  if raw and redis.call('ZREM', KEYS[1], id) == 1 then
    local origin = redis.call('HGET', KEYS[5], id)
    if not (origin and lists[origin]) then origin = KEYS[6] end
    redis.call('RPUSH', origin, raw)
    n = n + 1
  end
  redis.call('HDEL', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
  redis.call('HDEL', KEYS[4], id)
  redis.call('HDEL', KEYS[5], id)
end
return n
