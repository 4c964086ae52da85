-- take: move up to ARGV[1] requests from the request lists into flight, and pop this coordinator's
-- batch reports, in one atomic step (a coordinator killed at any instant leaves every request either
-- in a list or in flight). A request from any list but the last (the base list) has its list recorded
-- as its origin, so that a recovery puts it back there.
-- KEYS[1] lease ZSET, KEYS[2] raw HASH, KEYS[3] this coordinator's report list, KEYS[4] origin HASH,
-- KEYS[5..] request lists in drain order, the base list last.
-- ARGV[1] max requests, ARGV[2] lease ms, ARGV[3] max reports (0 = none).
-- Returns {{id1, raw1, id2, raw2, ...}, {reports, oldest first}}.

local expiry = lease_expiry(ARGV[2])
local want = tonumber(ARGV[1])
local SPACE, QUOTE = string.byte(' '), string.byte('"')
-- Writes are gathered and sent as one variadic command per key (a chunk at a time, within Lua's
-- stack limit for unpack): a command per request costs Redis more than a member more in one command.
local raw_pairs, lease_pairs, origin_pairs = {}, {}, {}
local reports = {}
if tonumber(ARGV[3]) > 0 then reports = redis.call('RPOP', KEYS[3], ARGV[3]) or {} end
local base = KEYS[#KEYS]
for i = 5, #KEYS do
  local left = want - #raw_pairs / 2
  if left <= 0 then break end
  local got = redis.call('RPOP', KEYS[i], left)
  if got then
    for _, raw in ipairs(got) do
      -- The task id is the one '"id": "..."' key of a Celery message (the body is base64, and a quote
      -- inside any JSON string is escaped): a plain find costs far less than a cjson decode of the
      -- whole message or a pattern scan. Anything unusual (no such key, or more than one) is decoded.
      -- One pass finds both spellings ('"id": "' and '"id":"'), stopping at a second match.
      local id, found = nil, 0
      local init = 1
      while found < 2 do
        local s, e = string.find(raw, '"id":', init, true)
        if not s then break end
        local value = e + 1
        if string.byte(raw, value) == SPACE then value = value + 1 end
        if string.byte(raw, value) == QUOTE then
          found = found + 1
          id = string.match(raw, '^[^"]+', value + 1)
        end
        init = e + 1
      end
      -- An id with an escape in its JSON form (kombu writes 'é' as '\u00e9'; a quote, a backslash)
      -- is decoded: read verbatim it is not the id its caller waits on.
      if found == 1 and id ~= nil and string.find(id, '\\', 1, true) then found = 0 end
      local ok, msg = true, nil
      if found ~= 1 then
        id = nil
        ok, msg = pcall(cjson.decode, raw)
      end
      if id ~= nil then
        -- unambiguous: taken as is
      elseif ok and type(msg) == 'table' and type(msg['headers']) == 'table' then
        id = msg['headers']['id']
      elseif not ok then
        -- cjson refuses some valid JSON (a lone surrogate escape in the text); find the id by pattern
        -- so the request still gets its stored error instead of being dead-lettered unanswered.
        -- Inside a JSON string a quote is escaped, so '"id"' right after '{' or ',' is the header key.
        id = string.match(raw, '[{,] ?"id": ?"([^"]+)"')
      end
      if type(id) ~= 'string' or id == '' then id = 'carpool-garbage-' .. redis.sha1hex(raw) end
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
end
chunked('HSET', KEYS[2], raw_pairs, 1, 2 * CHUNK)
chunked('ZADD', KEYS[1], lease_pairs, 1, 2 * CHUNK)
chunked('HSET', KEYS[4], origin_pairs, 1, 2 * CHUNK)
-- The reply's pairs are the raw hash's: {id1, raw1, id2, raw2, ...}.
return {raw_pairs, reports}
