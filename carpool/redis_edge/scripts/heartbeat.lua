-- heartbeat: announce a worker until a given time from now, drop the expired, count the live.
-- KEYS[1] workers ZSET. ARGV[1] hostname ('' = only count), ARGV[2] ttl ms.
-- Returns how many workers are live.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

if ARGV[1] ~= '' then redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1]) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
