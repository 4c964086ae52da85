-- take: move up to ARGV[1] requests from the request lists into flight, and pop this coordinator's
-- batch reports, in one atomic step (a coordinator killed at any instant leaves every request either
-- in a list or in flight). A request from any list but the last (the base list) has its list recorded
-- as its origin, so that a recovery puts it back there.
-- KEYS[1] lease ZSET, KEYS[2] raw HASH, KEYS[3] this coordinator's report list, KEYS[4] origin HASH,
-- KEYS[5] deaths HASH (how often a worker died running a request: requeue counts them), KEYS[6..]
-- request lists in drain order, the base list last.
-- ARGV[1] max requests, ARGV[2] lease ms, ARGV[3] max reports (0 = none), ARGV[4] max bytes (0 = no
-- limit): the take stops at the message that brings its total to that, and puts what it popped
-- past it back where it was, so that huge messages come a few at a time (at least one a take).
-- Returns {{id1, raw1, id2, raw2, ...}, {reports, oldest first}, {id, deaths, ...}}: the last, of
-- the requests taken that a worker died running (none while no request has: one EXISTS a take).

local expiry = lease_expiry(ARGV[2])
local want = tonumber(ARGV[1])
local budget = tonumber(ARGV[4]) or 0
local bytes, full = 0, false
local SPACE, QUOTE = string.byte(' '), string.byte('"')

-- Whether s is UTF-8 as Python's strict decoder reads it (no overlong form, no surrogate, nothing
-- past U+10FFFF): every process decodes the ids a take hands over, so an id that is not becomes a
-- garbage id. Only ids read by a decode or a pattern are checked; a plain one is ASCII.
local function utf8_valid(s)
  if not string.find(s, '[\128-\255]') then return true end
  local i, n = 1, #s
  while i <= n do
    local c = string.byte(s, i)
    local more, low, high = 0, 0x80, 0xBF
    if c < 0x80 then more = 0
    elseif c >= 0xC2 and c <= 0xDF then more = 1
    elseif c >= 0xE0 and c <= 0xEF then
      more = 2
      if c == 0xE0 then low = 0xA0 elseif c == 0xED then high = 0x9F end
    elseif c >= 0xF0 and c <= 0xF4 then
      more = 3
      if c == 0xF0 then low = 0x90 elseif c == 0xF4 then high = 0x8F end
    else return false end
    if i + more > n then return false end
    for j = 1, more do
      local b = string.byte(s, i + j)
      if b < low or b > high then return false end
      low, high = 0x80, 0xBF  -- only the second byte has a narrower range
    end
    i = i + more + 1
  end
  return true
end
-- Writes are gathered and sent as one variadic command per key (a chunk at a time, within Lua's
-- stack limit for unpack): a command per request costs Redis more than a member more in one command.
local raw_pairs, lease_pairs, origin_pairs = {}, {}, {}
local reports = {}
if tonumber(ARGV[3]) > 0 then reports = redis.call('RPOP', KEYS[3], ARGV[3]) or {} end
local base = KEYS[#KEYS]
for i = 6, #KEYS do
  local left = want - #raw_pairs / 2
  if left <= 0 or (budget > 0 and bytes >= budget) then break end
  local got = redis.call('RPOP', KEYS[i], left)
  if got then
    for n, raw in ipairs(got) do
      if budget > 0 and bytes >= budget then
        -- got[n..] back at the list's tail, got[n] last, so the list reads as before the pop.
        local back = {}
        for j = #got, n, -1 do back[#back + 1] = got[j] end
        chunked('RPUSH', KEYS[i], back)
        full = true
        break
      end
      bytes = bytes + #raw
      -- The task id is the one '"id": "..."' key of a Celery message (the body is base64, and a quote
      -- inside any JSON string is escaped): a plain find costs far less than a cjson decode of the
      -- whole message or a pattern scan. Anything unusual (no such key, or more than one) is decoded.
      -- One pass finds both spellings ('"id": "' and '"id":"'), stopping at a second match.
      -- The match stops at the closing quote only for an id of plain ASCII without escapes.
      local id, found, plain = nil, 0, false
      local init = 1
      while found < 2 do
        local s, e = string.find(raw, '"id":', init, true)
        if not s then break end
        local value = e + 1
        if string.byte(raw, value) == SPACE then value = value + 1 end
        if string.byte(raw, value) == QUOTE then
          found = found + 1
          id = string.match(raw, '^[^"\\\128-\255]+', value + 1)
          plain = id ~= nil and string.byte(raw, value + 1 + #id) == QUOTE
        end
        init = e + 1
      end
      -- An id with an escape in its JSON form (kombu writes 'é' as '\u00e9'; a quote, a backslash)
      -- is decoded: read verbatim it is not the id its caller waits on. So is one with a byte past
      -- ASCII (a client writing UTF-8, or bytes that are not UTF-8), to be checked below.
      local slow = found ~= 1 or not plain
      local ok, msg = true, nil
      if slow then
        id = nil
        ok, msg = pcall(cjson.decode, raw)
      end
      if not slow then
        -- unambiguous: taken as is
      elseif ok and type(msg) == 'table' and type(msg['headers']) == 'table' then
        id = msg['headers']['id']
        -- Celery's task message protocol 1 has no id header: its id is the correlation id (and in its
        -- body). Taken under it, the request is answered there (refused: carpool reads protocol 2).
        if id == nil and type(msg['properties']) == 'table' then id = msg['properties']['correlation_id'] end
      elseif not ok then
        -- cjson refuses some valid JSON (a lone surrogate escape in the text); find the id by pattern
        -- so the request still gets its stored error instead of being dead-lettered unanswered.
        -- Inside a JSON string a quote is escaped, so '"id"' right after '{' or ',' is the header key.
        id = string.match(raw, '[{,] ?"id": ?"([^"]+)"')
      end
      -- An id that is not UTF-8 would fail every process that decodes it (the take's reply first);
      -- named as garbage, the message is dead-lettered alone (its id no longer its message's).
      if type(id) ~= 'string' or id == '' or (slow and not utf8_valid(id)) then
        id = 'carpool-garbage-' .. redis.sha1hex(raw)
      end
      raw_pairs[#raw_pairs + 1] = id
      raw_pairs[#raw_pairs + 1] = raw
      lease_pairs[#lease_pairs + 1] = expiry
      lease_pairs[#lease_pairs + 1] = id
      if KEYS[i] ~= base then
        origin_pairs[#origin_pairs + 1] = id
        origin_pairs[#origin_pairs + 1] = KEYS[i]
      end
    end
  end
  if full then break end
end
chunked('HSET', KEYS[2], raw_pairs, 1, 2 * CHUNK)
chunked('ZADD', KEYS[1], lease_pairs, 1, 2 * CHUNK)
chunked('HSET', KEYS[4], origin_pairs, 1, 2 * CHUNK)
local deaths = {}
if #raw_pairs > 0 and redis.call('EXISTS', KEYS[5]) == 1 then
  local ids = {}
  for j = 1, #raw_pairs, 2 do ids[#ids + 1] = raw_pairs[j] end
  local counts = chunked('HMGET', KEYS[5], ids)
  for k = 1, #ids do
    if counts[k] then
      deaths[#deaths + 1] = ids[k]
      deaths[#deaths + 1] = counts[k]
    end
  end
end
-- The reply's pairs are the raw hash's: {id1, raw1, id2, raw2, ...}.
return {raw_pairs, reports, deaths}
