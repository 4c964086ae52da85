-- claim: a worker marks the requests its batch still owns as claimed and renews their leases (those
-- not renewed lately: lease_expiry); with a results db, also says which of them already have a
-- stored result (a rerun after recovery); and counts the batch messages queued behind this one; and
-- may take the next of them off its list, so the worker runs it without another round trip to
-- fetch it.
-- KEYS[1] lease ZSET, KEYS[2] owner HASH, KEYS[3] claimed HASH,
-- then, with a results db, KEYS[3 + i] the result key of the i-th id,
-- then the batch queue LISTs to count (none: the count is 0).
-- ARGV[1] batch id, ARGV[2] lease ms, ARGV[3] results db ('' = do not look for results),
-- ARGV[4] what the next message must contain to be taken ('' = take none), ARGV[5..] request ids.
-- Returns per id: 0 = not this batch's, 1 = claimed, 2 = claimed but answered already; then the
-- number of messages on the batch queue lists (the one taken included); then, if one was taken,
-- the position of its list among those named (1-based) and the message.

local batch = ARGV[1]
local expiry, renew_below = lease_expiry(ARGV[2])
-- A missing field or member reads as false.
local owners = chunked('HMGET', KEYS[2], ARGV, 5)
local scores = chunked('ZMSCORE', KEYS[1], ARGV, 5)
local out = {}
local claimed_pairs, lease_pairs = {}, {}
for i = 5, #ARGV do
  local k = i - 4
  if owners[k] == batch and scores[k] then
    claimed_pairs[#claimed_pairs + 1] = ARGV[i]
    claimed_pairs[#claimed_pairs + 1] = batch
    if tonumber(scores[k]) < renew_below then
      lease_pairs[#lease_pairs + 1] = expiry
      lease_pairs[#lease_pairs + 1] = ARGV[i]
    end
    out[k] = 1
  else
    out[k] = 0
  end
end
if #claimed_pairs > 0 then keep_as_table(KEYS[3]) end
chunked('HSET', KEYS[3], claimed_pairs, 1, 2 * CHUNK)
chunked('ZADD', KEYS[1], lease_pairs, 1, 2 * CHUNK, 'XX')
local ids = #ARGV - 4
local first_list = 4
if ARGV[3] ~= '' then first_list = 4 + ids end
local queued = 0
for k = first_list, #KEYS do
  queued = queued + redis.call('LLEN', KEYS[k])
end
-- The next message is taken from the end BRPOP takes from, as kombu would deliver it, and only if it
-- is the kind the caller asked for: another task's message stays for the worker's own consumer.
local taken = nil
if ARGV[4] ~= '' and queued > 0 then
  for k = first_list, #KEYS do
    local next_message = redis.call('LINDEX', KEYS[k], -1)
    if next_message then
      if string.find(next_message, ARGV[4], 1, true) then
        redis.call('RPOP', KEYS[k])
        taken = {k - first_list + 1, next_message}
      end
      break
    end
  end
end
if ARGV[3] ~= '' then
  -- SELECT in a script switches only the script's database, never the caller's (Redis >= 2.8.12).
  redis.call('SELECT', ARGV[3])
  local result_keys = {}
  for i = 1, #out do
    if out[i] == 1 then result_keys[#result_keys + 1] = KEYS[3 + i] end
  end
  -- One variadic EXISTS says whether any is answered (a rerun after recovery, rare); only then is
  -- each asked on its own.
  local answered = 0
  for first = 1, #result_keys, CHUNK do
    local last = math.min(first + CHUNK - 1, #result_keys)
    answered = answered + redis.call('EXISTS', unpack(result_keys, first, last))
  end
  if answered > 0 then
    for i = 1, #out do
      if out[i] == 1 and redis.call('EXISTS', KEYS[3 + i]) == 1 then out[i] = 2 end
    end
  end
end
out[#out + 1] = queued
if taken then
  out[#out + 1] = taken[1]
  out[#out + 1] = taken[2]
end
return out
