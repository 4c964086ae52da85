-- renew_held: renew the leases of requests a coordinator holds or dispatched, skipping those a worker
-- has claimed (a claimed request's lease is its worker's to renew).
-- KEYS[1] lease ZSET, KEYS[2] owner HASH, KEYS[3] claimed HASH.
-- ARGV[1] lease ms, ARGV[2..] request ids.
-- Returns how many leases were renewed.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- Reads and writes go as one variadic command per key, a chunk at a time (Lua's stack limit for
-- unpack): a command per request costs Redis more than a member more in one command.
local CHUNK = 1000
local function read_chunks(command, key)
  local all = {}
  for first = 2, #ARGV, CHUNK do
    local got = redis.call(command, key, unpack(ARGV, first, math.min(first + CHUNK - 1, #ARGV)))
    for _, v in ipairs(got) do all[#all + 1] = v end
  end
  return all
end

local expiry = now + tonumber(ARGV[1])
-- A missing field or member reads as false.
local scores = read_chunks('ZMSCORE', KEYS[1])
local owners = read_chunks('HMGET', KEYS[2])
local claimed = read_chunks('HMGET', KEYS[3])
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
for first = 1, #lease_pairs, 2 * CHUNK do
  local last = math.min(first + 2 * CHUNK - 1, #lease_pairs)
  redis.call('ZADD', KEYS[1], 'XX', unpack(lease_pairs, first, last))
end
return n
