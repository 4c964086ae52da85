-- stats: add to the counters every coordinator shares what one writer counted since its totals were
-- last applied, idempotently: the writer sends its running totals, and what reaches the shared hash
-- is each total less the one applied before (kept per writer). A call sent again after its reply
-- was lost, or a later one after a failed call, adds nothing twice.
-- KEYS[1] shared counters HASH, KEYS[2] this writer's applied totals HASH.
-- ARGV[1] seconds the applied totals outlive the writer's last call, then name, total pairs.
-- Returns how many counters changed.
local names, totals = {}, {}
for i = 2, #ARGV, 2 do
  names[#names + 1] = ARGV[i]
  totals[#totals + 1] = ARGV[i + 1]
end
local applied = chunked('HMGET', KEYS[2], names)
local changed = 0
for k = 1, #names do
  local delta = tonumber(totals[k]) - (tonumber(applied[k]) or 0)
  if delta ~= 0 then
    redis.call('HINCRBY', KEYS[1], names[k], string.format('%.0f', delta))
    changed = changed + 1
  end
end
chunked('HSET', KEYS[2], ARGV, 2, 2 * CHUNK)
redis.call('EXPIRE', KEYS[2], ARGV[1])
return changed
