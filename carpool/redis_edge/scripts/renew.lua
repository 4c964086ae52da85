-- renew: renew the leases of a running batch's requests that are still in flight.
-- KEYS[1] lease ZSET. ARGV[1] lease ms, ARGV[2..] request ids.
-- Returns how many ids were given.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local expiry = now + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[i]) end
return #ARGV - 1
