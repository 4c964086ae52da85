-- heartbeat: announce a worker until a given time from now, with the batch queues it consumes; drop
-- the expired (and, given the queues HASH, the queues of every worker no longer live), count the live.
-- KEYS[1] workers ZSET, KEYS[2] (optional) worker queues HASH.
-- ARGV[1] hostname ('' = only count), ARGV[2] ttl ms, ARGV[3] (with KEYS[2]) its batch queues, JSON.
-- Returns how many workers are live.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

if ARGV[1] ~= '' then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
  if KEYS[2] then redis.call('HSET', KEYS[2], ARGV[1], ARGV[3]) end
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if KEYS[2] then
  -- By membership, not by expiry: a count-only call (a coordinator's) drops expired workers without
  -- their queues. The hash holds one field per worker that said its queues.
  local named = redis.call('HKEYS', KEYS[2])
  if #named > 0 then
    local scores = chunked('ZMSCORE', KEYS[1], named)
    local gone = {}
    for i = 1, #named do
      if not scores[i] then gone[#gone + 1] = named[i] end
    end
    chunked('HDEL', KEYS[2], gone)
  end
end
return redis.call('ZCARD', KEYS[1])
