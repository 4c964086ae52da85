-- outbox: the links outbox's due entries, each leased again to the caller. An entry is due when the
-- worker that filed it with its request's result (finish.lua) did not empty it within a lease: it
-- died before sending the links. The caller sends them and empties the entries; should it die
-- first, the entries come due again a lease later, for any caller. An id with no entry left (the
-- worker emptied it between the two writes) is dropped.
-- KEYS[1] outbox ZSET (request id -> due, ms), KEYS[2] its HASH (request id -> entry).
-- ARGV[1] most entries to return, ARGV[2] the caller's lease, ms.
-- Returns request id, entry, ... for each entry taken.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%.0f', now), 'LIMIT', 0, tonumber(ARGV[1]))
if #due == 0 then return {} end
local again = lease_expiry(ARGV[2])
local out = {}
for _, id in ipairs(due) do
  local entry = redis.call('HGET', KEYS[2], id)
  if entry then
    redis.call('ZADD', KEYS[1], again, id)
    out[#out + 1] = id
    out[#out + 1] = entry
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
return out
