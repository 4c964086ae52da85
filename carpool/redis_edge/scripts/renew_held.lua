-- renew_held: renew the leases of requests a coordinator holds or dispatched, skipping those a worker
-- has claimed (a claimed request's lease is its worker's to renew).
-- KEYS[1] lease ZSET, KEYS[2] owner HASH, KEYS[3] claimed HASH.
-- ARGV[1] lease ms, ARGV[2..] request ids.
-- Returns how many leases were renewed.

-- Reads and writes go as one variadic command per key, a chunk at a time (Lua's stack limit for
-- unpack): a command per request costs Redis more than a member more in one command.

local expiry = lease_expiry(ARGV[1])
-- A missing field or member reads as false.
local scores = chunked('ZMSCORE', KEYS[1], ARGV, 2)
local owners = chunked('HMGET', KEYS[2], ARGV, 2)
local claimed = chunked('HMGET', KEYS[3], ARGV, 2)
local lease_pairs = {}
local n = 0
for i = 2, #ARGV do
  local k = i - 1
  if scores[k] and (not claimed[k] or claimed[k] ~= owners[k]) then
    lease_pairs[#lease_pairs + 1] = expiry
    lease_pairs[#lease_pairs + 1] = ARGV[i]
    n = n + 1
  end
end
chunked('ZADD', KEYS[1], lease_pairs, 1, 2 * CHUNK, 'XX')
return n
