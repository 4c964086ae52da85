-- finish: the one place results are stored. Each result is SET only if none is stored yet
-- (write-once: a rerun never overwrites the first answer) and PUBLISHed to wake waiting producers,
-- on its own channel and, when its producer named one, on that producer's result inbox too.
-- (One message per inbox joining its results would cost Redis more: building a long Lua string
-- costs more than publishing its pieces.)
-- Then, for a worker's batch, the acknowledged ids leave every in-flight key, the batch report goes to
-- its coordinator and the task events are published: a batch finished in one round trip, across the
-- result and broker databases of one server. With only results given it stores them and nothing more.
-- A call whose reply was lost (a timeout, a reset connection) is sent again with the same bytes: a
-- batch's results are encoded once, date_done and all. A write refused because the key holds the
-- very value written is then this call's own, from its first sending: its index is returned as
-- stored, but it is not published again (the first sending did; a producer subscribing later reads
-- the key). Another run's answer differs, in its date_done at least, so finding one marks a resend,
-- which skips the report and task events its first sending pushed; the acks run again, harmlessly.
-- Task events are published only when every result was stored (see below).
-- (A resend of a call that stored nothing looks like a first sending and pushes its report again.)
-- Only a refused write costs a GET. A key given twice in one call keeps its second write refused.
-- A request with links (callbacks, error callbacks, a chain) whose result this call stores goes into
-- the links outbox (the ZSET holds when its links are due, the HASH what they are) in the same
-- step: the worker sends the links next and empties its entries; should it die first, a
-- coordinator finds them due a lease later and sends them (carpool.coordinator.outbox).
-- KEYS[1..n] result keys, then (only when acknowledging or reporting) KEYS[n+1] lease ZSET,
-- KEYS[n+2] raw HASH, KEYS[n+3] owner HASH, KEYS[n+4] claimed HASH, KEYS[n+5] origin HASH,
-- KEYS[n+6] report list, KEYS[n+7] deaths HASH, KEYS[n+8] links outbox ZSET, KEYS[n+9] its HASH.
-- ARGV[1] n, ARGV[2] results db ('' = the caller's), ARGV[3] broker db ('' = the caller's),
-- ARGV[4] result expiry s (0 = none), ARGV[5..4+n] encoded results, then ARGV[5+n] report json
-- ('' = none), ARGV[6+n] reports kept, ARGV[7+n] reports ttl s, ARGV[8+n] events topic ('' = none),
-- ARGV[9+n] events message, ARGV[10+n] m: inboxes given (0, or n: one per result), ARGV[11+n] the
-- prefix every inbox channel starts with (others are not published to), ARGV[12+n..11+n+m] each
-- result's inbox channel ('' = none), ARGV[12+n+m] k: requests with links, ARGV[13+n+m] ms until
-- their links are due, ARGV[14+n+m..13+n+m+3k] per such request its result's index, its id and its
-- outbox entry, then ARGV[14+n+m+3k..] ids to acknowledge.
-- Returns the 1-based indexes of the results stored, by this call or by its first sending.
local n = tonumber(ARGV[1])
-- An expiry of 0 stores for good, as Celery's backend does with result_expires=None.
local forever = ARGV[4] == '0'
local m = tonumber(ARGV[10 + n])
local k = tonumber(ARGV[12 + n + m])
local fresh = nil  -- result index -> true when this call stored it: only with links to file
if k > 0 then fresh = {} end
-- SELECT in a script switches only the script's database, never the caller's (Redis >= 2.8.12).
if ARGV[2] ~= '' then redis.call('SELECT', ARGV[2]) end
local stored = {}
local resent = false
local first_at = nil  -- result key -> its first index in KEYS, built at the first refused write
local prefix = ARGV[11 + n]
local allowed = {}  -- inbox channel -> whether it starts with the prefix
for i = 1, n do
  local key = KEYS[i]
  local meta = ARGV[4 + i]
  local set
  if forever then
    set = redis.call('SET', key, meta, 'NX')
  else
    set = redis.call('SET', key, meta, 'NX', 'EX', ARGV[4])
  end
  if set then
    redis.call('PUBLISH', key, meta)
    stored[#stored + 1] = i
    if fresh then fresh[i] = true end
    if m > 0 then
      local inbox = ARGV[11 + n + i]
      if inbox ~= '' then
        local ok = allowed[inbox]
        if ok == nil then
          ok = string.sub(inbox, 1, #prefix) == prefix
          allowed[inbox] = ok
        end
        if ok then redis.call('PUBLISH', inbox, meta) end
      end
    end
  else
    if first_at == nil then
      first_at = {}
      for j = n, 1, -1 do first_at[KEYS[j]] = j end
    end
    -- pcall: a key of another type is refused like any other answer, not an error that would stop
    -- the script halfway (Redis does not undo a script's earlier writes).
    if first_at[key] == i and redis.pcall('GET', key) == meta then
      stored[#stored + 1] = i
      resent = true
    end
  end
end
if ARGV[3] ~= '' then redis.call('SELECT', ARGV[3]) end
-- A resend files nothing: its first sending filed what it stored, and the worker may have sent
-- those links and emptied the entries since.
if k > 0 then
  local due = lease_expiry(ARGV[13 + n + m])
  for j = 14 + n + m, 13 + n + m + 3 * k, 3 do
    if fresh[tonumber(ARGV[j])] then
      redis.call('ZADD', KEYS[n + 8], due, ARGV[j + 1])
      redis.call('HSET', KEYS[n + 9], ARGV[j + 1], ARGV[j + 2])
    end
  end
end
-- Variadic deletes, a chunk at a time to stay within Lua's stack limit for unpack.
for first = 14 + n + m + 3 * k, #ARGV, 1000 do
  local last = math.min(first + 999, #ARGV)
  redis.call('ZREM', KEYS[n + 1], unpack(ARGV, first, last))
  redis.call('HDEL', KEYS[n + 2], unpack(ARGV, first, last))
  redis.call('HDEL', KEYS[n + 3], unpack(ARGV, first, last))
  redis.call('HDEL', KEYS[n + 4], unpack(ARGV, first, last))
  redis.call('HDEL', KEYS[n + 5], unpack(ARGV, first, last))
  redis.call('HDEL', KEYS[n + 7], unpack(ARGV, first, last))
end
local report = ARGV[5 + n]
if report ~= '' and not resent then
  redis.call('LPUSH', KEYS[n + 6], report)
  redis.call('LTRIM', KEYS[n + 6], 0, tonumber(ARGV[6 + n]) - 1)
  redis.call('EXPIRE', KEYS[n + 6], ARGV[7 + n])
end
-- The task events only when every result was stored: those of a result refused (its request answered
-- meanwhile: revoked, or run before) would say what its caller never gets; the caller sends them
-- corrected.
if ARGV[8 + n] ~= '' and not resent and #stored == n then redis.call('PUBLISH', ARGV[8 + n], ARGV[9 + n]) end
return stored
