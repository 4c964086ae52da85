-- claim: a worker marks the requests its batch still owns as claimed and renews their leases; with a
-- results db, also says which of them already have a stored result (a rerun after recovery); and
-- counts the batch messages queued behind this one.
-- KEYS[1] lease ZSET, KEYS[2] owner HASH, KEYS[3] claimed HASH,
-- then, with a results db, KEYS[3 + i] the result key of the i-th id,
-- then the batch queue LISTs to count (none: the count is 0).
-- ARGV[1] batch id, ARGV[2] lease ms, ARGV[3] results db ('' = do not look for results),
-- ARGV[4..] request ids.
-- Returns per id: 0 = not this batch's, 1 = claimed, 2 = claimed but answered already; then one
-- more element, the number of messages on the batch queue lists.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- Reads and writes go as one variadic command per key, a chunk at a time (Lua's stack limit for
-- unpack): a command per request costs Redis more than a member more in one command.
local CHUNK = 1000
local function each_chunk(command, key, option, args, step)
  for first = 1, #args, step do
    local last = math.min(first + step - 1, #args)
    if option then
      redis.call(command, key, option, unpack(args, first, last))
    else
      redis.call(command, key, unpack(args, first, last))
    end
  end
end
local function read_chunks(command, key, first_arg)
  local all = {}
  for first = first_arg, #ARGV, CHUNK do
    local got = redis.call(command, key, unpack(ARGV, first, math.min(first + CHUNK - 1, #ARGV)))
    for _, v in ipairs(got) do all[#all + 1] = v end
  end
  return all
end

local batch = ARGV[1]
local expiry = now + tonumber(ARGV[2])
-- A missing field or member reads as false.
local owners = read_chunks('HMGET', KEYS[2], 4)
local scores = read_chunks('ZMSCORE', KEYS[1], 4)
local out = {}
local claimed_pairs, lease_pairs = {}, {}
for i = 4, #ARGV do
  local k = i - 3
  if owners[k] == batch and scores[k] then
    claimed_pairs[#claimed_pairs + 1] = ARGV[i]
    claimed_pairs[#claimed_pairs + 1] = batch
    lease_pairs[#lease_pairs + 1] = expiry
    lease_pairs[#lease_pairs + 1] = ARGV[i]
    out[k] = 1
  else
    out[k] = 0
  end
end
each_chunk('HSET', KEYS[3], nil, claimed_pairs, 2 * CHUNK)
each_chunk('ZADD', KEYS[1], 'XX', lease_pairs, 2 * CHUNK)
local ids = #ARGV - 3
local first_list = 4
if ARGV[3] ~= '' then first_list = 4 + ids end
local queued = 0
for k = first_list, #KEYS do
  queued = queued + redis.call('LLEN', KEYS[k])
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
return out
