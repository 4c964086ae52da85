-- heartbeat: announce a worker until a given time from now, with the batch queues it consumes; drop
-- the expired (and, given the queues HASH, their queues), count the live.
-- KEYS[1] workers ZSET, KEYS[2] (optional) worker queues HASH.
-- ARGV[1] hostname ('' = only count), ARGV[2] ttl ms, ARGV[3] (with KEYS[2]) its batch queues, JSON.
-- Returns how many workers are live.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

if ARGV[1] ~= '' then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
  if KEYS[2] then redis.call('HSET', KEYS[2], ARGV[1], ARGV[3]) end
end
if KEYS[2] then
  local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
  chunked('HDEL', KEYS[2], expired)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
