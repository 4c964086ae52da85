-- dispatch: hand a coordinator step's batches on, atomically (a worker never sees a batch whose
-- ownership is not recorded yet). Publishes the events first, so Flower sees requests received before
-- any worker starts them; then per batch records it as owner of its requests still in flight, renews
-- their leases (those not renewed lately: lease_expiry) and pushes the batch's task message. A new
-- owner supersedes any earlier claim, since a request counts as claimed only while its claimed batch
-- equals its owner.
-- KEYS[1] lease ZSET, KEYS[2] owner HASH, KEYS[3] batch queue list.
-- ARGV[1] lease ms, ARGV[2] events topic ('' = none), ARGV[3] events message,
-- then per batch: batch id, count n, n request ids, the batch's task message.
-- Returns how many requests were assigned.

local expiry, renew_below = lease_expiry(ARGV[1])
if ARGV[2] ~= '' then redis.call('PUBLISH', ARGV[2], ARGV[3]) end
local ids, owners, messages = {}, {}, {}
local i = 4
while i <= #ARGV do
  local batch = ARGV[i]
  local count = tonumber(ARGV[i + 1])
  for j = i + 2, i + 1 + count do
    ids[#ids + 1] = ARGV[j]
    owners[#owners + 1] = batch
  end
  messages[#messages + 1] = ARGV[i + 2 + count]
  i = i + 3 + count
end
local scores = chunked('ZMSCORE', KEYS[1], ids)
local owner_pairs, lease_pairs = {}, {}
local n = 0
for k = 1, #ids do
  -- ZMSCORE answers false for a member not in the set: that request is no longer in flight.
  if scores[k] then
    owner_pairs[#owner_pairs + 1] = ids[k]
    owner_pairs[#owner_pairs + 1] = owners[k]
    if tonumber(scores[k]) < renew_below then
      lease_pairs[#lease_pairs + 1] = expiry
      lease_pairs[#lease_pairs + 1] = ids[k]
    end
    n = n + 1
  end
end
if n > 0 then keep_as_table(KEYS[2]) end
chunked('HSET', KEYS[2], owner_pairs, 1, 2 * CHUNK)
chunked('ZADD', KEYS[1], lease_pairs, 1, 2 * CHUNK, 'XX')
chunked('LPUSH', KEYS[3], messages)
return n
