-- Prepended to every script (carpool.redis_edge.lua.source). Reads and writes go as one variadic
-- command per key, a chunk of members at a time (Lua's stack limit for unpack): a command per
-- request costs Redis more than a member more in one command.
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

