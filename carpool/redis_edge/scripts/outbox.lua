-- outbox: the links outbox's due entries, each leased again to the caller. An entry is due when the
-- process that filed it with its request's result (a worker's finish.lua, a coordinator's refusal)
-- did not empty it within a lease: it died before sending the links (or took that long, and did not
-- renew it). The caller sends them and empties the entries; should it die first, the entries come
-- due again a lease later, for any caller. An id with no entry left (emptied between the two writes)
-- is dropped. So is an entry taken ARGV[3] times already: its links may be what kills or hangs each
-- process that sends them (an error callback Celery runs in the coordinator), and they are not sent
-- again.
-- KEYS[1] outbox ZSET (request id -> due, ms), KEYS[2] its HASH (request id -> entry), KEYS[3] the
-- HASH of how often each entry was taken.
-- ARGV[1] most entries to return, ARGV[2] the caller's lease, ms, ARGV[3] most takes of one entry.
-- Returns {{request id, entry, ...} for each entry taken, {request id, ...} of those dropped for it}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%.0f', now), 'LIMIT', 0, tonumber(ARGV[1]))
if #due == 0 then return {{}, {}} end
local again = lease_expiry(ARGV[2])
local most = tonumber(ARGV[3])
local out, dropped = {}, {}
for _, id in ipairs(due) do
  local entry = redis.call('HGET', KEYS[2], id)
  if not entry then
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[3], id)
  elseif redis.call('HINCRBY', KEYS[3], id, 1) > most then
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
    dropped[#dropped + 1] = id
  else
    redis.call('ZADD', KEYS[1], again, id)
    out[#out + 1] = id
    out[#out + 1] = entry
  end
end
return {out, dropped}
