-- dispatch: hand a coordinator step's batches on, atomically (a worker never sees a batch whose
-- ownership is not recorded yet). Publishes the events first, so Flower sees requests received before
-- any worker starts them; then per batch records it as owner of its requests still in flight, renews
-- their leases and pushes the batch's task message. A new owner supersedes any earlier claim, since
-- a request counts as claimed only while its claimed batch equals its owner.
-- KEYS[1] lease ZSET, KEYS[2] owner HASH, KEYS[3] batch queue list.
-- ARGV[1] lease ms, ARGV[2] events topic ('' = none), ARGV[3] events message,
-- then per batch: batch id, count n, n request ids, the batch's task message.
-- Returns how many requests were assigned.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local expiry = now + tonumber(ARGV[1])
if ARGV[2] ~= '' then redis.call('PUBLISH', ARGV[2], ARGV[3]) end
local n = 0
local i = 4
while i <= #ARGV do
  local batch = ARGV[i]
  local count = tonumber(ARGV[i + 1])
  for j = i + 2, i + 1 + count do
    local id = ARGV[j]
    if redis.call('ZSCORE', KEYS[1], id) then
      redis.call('HSET', KEYS[2], id, batch)
      redis.call('ZADD', KEYS[1], 'XX', expiry, id)
      n = n + 1
    end
  end
  redis.call('LPUSH', KEYS[3], ARGV[i + 2 + count])
  i = i + 3 + count
end
return n
