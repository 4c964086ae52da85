-- renew: renew the leases of a running batch's requests that are still in flight.
-- KEYS[1] lease ZSET. ARGV[1] lease ms, ARGV[2..] request ids.
-- Returns how many ids were given.

local expiry = lease_expiry(ARGV[1])
-- One variadic ZADD per chunk (Lua's stack limit for unpack), not one command per request.
local pairs_ = {}
for i = 2, #ARGV do
  pairs_[#pairs_ + 1] = expiry
  pairs_[#pairs_ + 1] = ARGV[i]
end
for first = 1, #pairs_, 2000 do
  redis.call('ZADD', KEYS[1], 'XX', unpack(pairs_, first, math.min(first + 1999, #pairs_)))
end
return #ARGV - 1
