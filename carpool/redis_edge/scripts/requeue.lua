-- requeue: put requests back at the front of the list each was taken from (its recorded origin, else
-- the base request list), verbatim and in the order given, and forget them in every in-flight key. Given ids, those (a
-- coordinator's shutdown); given none, every request whose lease has run out (its holder died), up
-- to a limit.
-- A request put back because its lease ran out while its worker was running its batch (on the
-- device, or storing its results) has that counted in the deaths hash (the worker died running it:
-- killed for memory, a crash; or it stopped renewing leases that long, holding the GIL, paused),
-- which stays with the request until it is answered: the coordinator then runs it alone, and from
-- the second names it. One claimed but still waiting to run did not kill its worker: it is not
-- counted. A dead worker's mark stays, for the requests of its batch whose leases run out later (a
-- claim leaves a lease with seven eighths of its length as it is, so a batch's leases differ),
-- until it is a day old.
-- KEYS[1] lease ZSET, KEYS[2] raw HASH, KEYS[3] owner HASH, KEYS[4] claimed HASH, KEYS[5] origin HASH,
-- KEYS[6] deaths HASH, KEYS[7] running ZSET, KEYS[8] the base request list, KEYS[9..] the other
-- request lists (an origin not among them counts as the base list).
-- ARGV[1] max expired requests, ARGV[2..] request ids (none = the expired ones).
-- Returns how many requests were put back.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)


local lists = {}
for i = 9, #KEYS do lists[KEYS[i]] = true end
local reaping = #ARGV <= 1
local ids
if not reaping then
  ids = {}
  for i = 2, #ARGV do ids[#ids + 1] = ARGV[i] end
else
  ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
end
-- A missing field or member reads as false.
local raws = chunked('HMGET', KEYS[2], ids)
local scores = chunked('ZMSCORE', KEYS[1], ids)
local origins = chunked('HMGET', KEYS[5], ids)
local claimed = {}
if reaping then claimed = chunked('HMGET', KEYS[4], ids) end
-- A request goes back once, and only while it has both its raw message and its lease; one with a raw
-- message but no lease is only forgotten.
local seen, forget, order, pushes = {}, {}, {}, {}
local running = {}  -- batch id -> whether its worker was running it (false: not)
local n = 0
for k, id in ipairs(ids) do
  if raws[k] and not seen[id] then
    seen[id] = true
    forget[#forget + 1] = id
    if scores[k] then
      local origin = origins[k]
      if not (origin and lists[origin]) then origin = KEYS[8] end
      local batch = claimed[k]
      if batch then
        if running[batch] == nil then running[batch] = redis.call('ZSCORE', KEYS[7], batch) ~= false end
        if running[batch] then redis.call('HINCRBY', KEYS[6], id, 1) end
      end
      if not pushes[origin] then
        pushes[origin] = {}
        order[#order + 1] = origin
      end
      local list = pushes[origin]
      list[#list + 1] = raws[k]
      n = n + 1
    end
  end
end
chunked('ZREM', KEYS[1], forget)
-- Pushed last one first: the take pops from the end pushed to, so the ids given first (the oldest,
-- as callers give them; when reaping, the first lease to run out, ties in id order) are taken first again.
for _, origin in ipairs(order) do
  local list = pushes[origin]
  for a = 1, math.floor(#list / 2) do
    local b = #list - a + 1
    list[a], list[b] = list[b], list[a]
  end
  chunked('RPUSH', origin, list)
end
for key = 2, 5 do chunked('HDEL', KEYS[key], ids) end
if reaping then redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', now - 86400000) end
return n
