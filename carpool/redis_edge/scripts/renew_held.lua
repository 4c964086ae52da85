-- renew_held: renew the leases of requests a coordinator holds or dispatched, skipping those a worker
-- has claimed (a claimed request's lease is its worker's to renew).
-- KEYS[1] lease ZSET, KEYS[2] owner HASH, KEYS[3] claimed HASH.
-- ARGV[1] lease ms, ARGV[2..] request ids.
-- Returns how many leases were renewed.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local expiry = now + tonumber(ARGV[1])
local n = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  if redis.call('ZSCORE', KEYS[1], id) then
    local claimed_by = redis.call('HGET', KEYS[3], id)
    if not claimed_by or claimed_by ~= redis.call('HGET', KEYS[2], id) then
      redis.call('ZADD', KEYS[1], 'XX', expiry, id)
      n = n + 1
    end
  end
end
return n
