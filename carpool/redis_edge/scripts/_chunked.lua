-- Prepended to every script (carpool.redis_edge.lua.source): the helpers they share. Reads and
-- writes go as one variadic command per key, a chunk of members at a time (Lua's stack limit for
-- unpack): a command per request costs Redis more than a member more in one command.
local CHUNK = 1000

-- redis.call(command, key, [option,] args[first..last]) for each chunk of `step` (default CHUNK)
-- members of `args` from index `from` (default 1); returns the chunks' table replies joined.
local function chunked(command, key, args, from, step, option)
  step = step or CHUNK
  local replies = {}
  for first = from or 1, #args, step do
    local last = math.min(first + step - 1, #args)
    local got
    if option then
      got = redis.call(command, key, option, unpack(args, first, last))
    else
      got = redis.call(command, key, unpack(args, first, last))
    end
    if type(got) == 'table' then
      for _, v in ipairs(got) do replies[#replies + 1] = v end
    end
  end
  return replies
end

-- When a lease taken now for `ms` milliseconds runs out (Redis's clock, ms): as the text ZADD is
-- given (a Lua number passed to redis.call is formatted again, by printf's "%.17g", for every
-- member; '%.0f', since Lua's '%d' goes through a C long, 32 bits on some builds), and the score
-- below which a held lease is worth renewing: one with seven eighths of its length and two seconds
-- left is kept as it is. Moving a lease costs Redis a skiplist move per request, and whoever holds
-- a request renews its lease well within that (the coordinator every quarter lease, a worker every
-- second).
local function lease_expiry(ms)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  return string.format('%.0f', now + tonumber(ms)), now + math.max(tonumber(ms) * 7 / 8, 2000)
end

-- Keeps a hash of request ids stored as a hash table however few ids it holds. Redis stores a hash
-- of up to 128 short fields as one flat list that every read and write scans end to end, and the
-- owner and claimed hashes hold a few batches' ids (~100) through a burst, where that scan cost
-- more than the rest of each command; one value longer than hash-max-listpack-value (64 bytes by
-- default) makes it a hash table for as long as the key lives. Its field, '', is never a request
-- id: take names a message without one carpool-garbage-<sha1>.
local TABLE_NOTE = 'carpool keeps this field so that Redis stores this hash as a hash table: '
  .. 'a small hash is a flat list searched end to end on every read and write'
local function keep_as_table(key)
  redis.call('HSETNX', key, '', TABLE_NOTE)
end
