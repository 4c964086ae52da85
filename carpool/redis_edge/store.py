"""Redis state shared by coordinators and workers: in-flight requests, leases, heartbeats, reports.

A request's life in Redis:
  request list --take--> in flight (raw kept, lease set) --dispatch--> owned by a batch
    --claim (worker)--> running --ack--> gone (its result is in the result backend)
  and from any in-flight state, when its lease runs out (the holder died): --reap--> back at the
  front of the request list, verbatim.

``take`` is one Lua script: the pop and the move into the in-flight hash are atomic, so a
coordinator killed at any instant leaves every request either in the list or in flight, never
nowhere. Leases use Redis's clock (TIME), so hosts with skewed clocks agree on expiry.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import redis

from carpool.redis_edge.keys import Keys

REPORTS_TTL_S = 3600

_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: lease, raw, this coordinator's report list, request lists in drain order.
# ARGV: max count, lease ms, max reports.
# Returns {flat list id1, raw1, id2, raw2, ..., reports (newest last)}: a step's intake in one trip.
_TAKE = (
    _NOW_MS
    + """
local expiry = now + tonumber(ARGV[2])
local want = tonumber(ARGV[1])
local ID_KEYS = {'"id": "', '"id":"'}
local out = {}
local reports = {}
if tonumber(ARGV[3]) > 0 then reports = redis.call('RPOP', KEYS[3], ARGV[3]) or {} end
for i = 4, #KEYS do
  local left = want - #out / 2
  if left <= 0 then break end
  local got = redis.call('RPOP', KEYS[i], left)
  if got then
    for _, raw in ipairs(got) do
      -- The task id is the one '"id": "..."' key of a Celery message (the body is base64, and a quote
      -- inside any JSON string is escaped): a plain find costs far less than a cjson decode of the
      -- whole message (or a pattern scan), which were most of this script's time. Anything unusual
      -- (no such key, or more than one) is decoded.
      local id, found = nil, 0
      for _, needle in ipairs(ID_KEYS) do
        local init = 1
        while found < 2 do
          local s, e = string.find(raw, needle, init, true)
          if not s then break end
          found = found + 1
          id = string.match(raw, '^[^"]+', e + 1)
          init = e + 1
        end
      end
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
      redis.call('HSET', KEYS[2], id, raw)
      redis.call('ZADD', KEYS[1], expiry, id)
      out[#out + 1] = id
      out[#out + 1] = raw
    end
  end
end
return {out, reports}
"""
)

# KEYS: lease, owner, batch queue list. ARGV: lease ms, events topic ('' = none), events message,
# then per batch: batch id, n, n request ids, the batch's task message.
# Publishes the events first (Flower sees requests received before any worker starts them), then
# per batch records its owner on the requests still in flight, renews their leases and pushes its
# message: the whole dispatch of a coordinator step is one atomic round trip, and a worker never
# sees a batch whose ownership is not recorded yet. Returns how many requests were assigned.
_DISPATCH = (
    _NOW_MS
    + """
local expiry = now + tonumber(ARGV[1])
if ARGV[2] ~= '' then redis.call('PUBLISH', ARGV[2], ARGV[3]) end
local n = 0
local i = 4
while i <= #ARGV do
  local batch = ARGV[i]
  local count = tonumber(ARGV[i + 1])
  for j = i + 2, i + 1 + count do
    local id = ARGV[j]
    if redis.call('ZSCORE', KEYS[1], id) then
      redis.call('HSET', KEYS[2], id, batch)
      redis.call('ZADD', KEYS[1], 'XX', expiry, id)
      n = n + 1
    end
  end
  redis.call('LPUSH', KEYS[3], ARGV[i + 2 + count])
  i = i + 3 + count
end
return n
"""
)

# KEYS: lease, owner. ARGV: lease ms, ids... Renews the lease of ids still in flight and not claimed by
# a worker (a claimed request's lease is its worker's to renew). Returns how many were renewed.
_RENEW_HELD = (
    _NOW_MS
    + """
local expiry = now + tonumber(ARGV[1])
local n = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  if redis.call('ZSCORE', KEYS[1], id) then
    local owner = redis.call('HGET', KEYS[2], id)
    if not owner or string.sub(owner, -1) ~= '!' then
      redis.call('ZADD', KEYS[1], 'XX', expiry, id)
      n = n + 1
    end
  end
end
return n
"""
)

# The claim loop shared by _CLAIM and _CLAIM_FRESH; FIRST_ID is the ARGV index of the first id.
_CLAIM_LOOP = """
local expiry = now + tonumber(ARGV[2])
local batch = ARGV[1]
local out = {}
for i = FIRST_ID, #ARGV do
  local id = ARGV[i]
  local owner = redis.call('HGET', KEYS[2], id)
  if (owner == batch or owner == batch .. '!') and redis.call('ZSCORE', KEYS[1], id) then
    redis.call('HSET', KEYS[2], id, batch .. '!')
    redis.call('ZADD', KEYS[1], 'XX', expiry, id)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
"""

# KEYS: lease, owner. ARGV: batch id, lease ms, ids... Marks the ids this batch still owns as claimed
# (owner 'batch!') and renews their lease. Returns 1/0 per id.
_CLAIM = _NOW_MS + _CLAIM_LOOP.replace("FIRST_ID", "3") + "return out\n"

# KEYS: lease, owner, then one result key per id. ARGV: batch id, lease ms, results db, ids...
# As _CLAIM, and also says which of the claimed ids already have a result (a rerun after recovery):
# 0 = not this batch's any more, 1 = claimed and unanswered, 2 = claimed but answered already.
_CLAIM_FRESH = (
    _NOW_MS
    + _CLAIM_LOOP.replace("FIRST_ID", "4")
    + """
redis.call('SELECT', ARGV[3])
for i = 1, #out do
  if out[i] == 1 and redis.call('EXISTS', KEYS[i + 2]) == 1 then out[i] = 2 end
end
return out
"""
)

# One round trip to finish a batch, across the result and broker databases of one Redis server
# (SELECT inside a script switches only the script's database, never the caller's; Redis >= 2.8.12).
# KEYS: lease, raw, owner, report list, then one result key per stored result.
# ARGV: results db, broker db, result expiry s, report json ('' = none), events topic ('' = none),
#       events message, number of results n, n encoded results, then the ids to acknowledge.
# Stores each result unless one is stored already (write-once) and PUBLISHes it, forgets the acked
# ids, pushes the report, publishes the events. Returns the 1-based indexes of the results stored.
_FINISH = """
local n = tonumber(ARGV[7])
redis.call('SELECT', ARGV[1])
local stored = {}
for i = 1, n do
  local key = KEYS[4 + i]
  local meta = ARGV[7 + i]
  if redis.call('SET', key, meta, 'NX', 'EX', ARGV[3]) then
    redis.call('PUBLISH', key, meta)
    stored[#stored + 1] = i
  end
end
redis.call('SELECT', ARGV[2])
for i = 8 + n, #ARGV do
  local id = ARGV[i]
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
end
if ARGV[4] ~= '' then
  redis.call('LPUSH', KEYS[4], ARGV[4])
  redis.call('LTRIM', KEYS[4], 0, 9999)
  redis.call('EXPIRE', KEYS[4], %d)
end
if ARGV[5] ~= '' then redis.call('PUBLISH', ARGV[5], ARGV[6]) end
return stored
"""

# KEYS: lease. ARGV: lease ms, ids... Renews leases of ids still in flight (a running batch).
_RENEW = (
    _NOW_MS
    + """
local expiry = now + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[i]) end
return #ARGV - 1
"""
)

# KEYS: lease, raw, owner, target list. ARGV: max count, then ids ('' ids = every expired lease).
# Puts requests back at the front of the target list, verbatim, and forgets them. Returns the count.
_REQUEUE = (
    _NOW_MS
    + """
local ids
if #ARGV > 1 then
  ids = {}
  for i = 2, #ARGV do ids[#ids + 1] = ARGV[i] end
else
  ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
end
local n = 0
for _, id in ipairs(ids) do
  local raw = redis.call('HGET', KEYS[2], id)
  if raw and redis.call('ZREM', KEYS[1], id) == 1 then
    redis.call('RPUSH', KEYS[4], raw)
    n = n + 1
  end
  redis.call('HDEL', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
end
return n
"""
)

# KEYS: workers. ARGV: hostname, ttl ms ('' hostname: just count). Returns live workers.
_HEARTBEAT = (
    _NOW_MS
    + """
if ARGV[1] ~= '' then redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1]) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""
)


class RequestStore:
    """The Redis edge for in-flight requests. One per process; thread-safe as redis-py is."""

    def __init__(self, client: redis.Redis, keys: Keys, lease_s: float) -> None:
        self.client = client
        self.keys = keys
        self.lease_ms = max(1, int(lease_s * 1000))
        self._take = client.register_script(_TAKE)
        self._renew_held = client.register_script(_RENEW_HELD)
        self._claim = client.register_script(_CLAIM)
        self._dispatch = client.register_script(_DISPATCH)
        self._claim_fresh = client.register_script(_CLAIM_FRESH)
        self._finish = client.register_script(_FINISH % REPORTS_TTL_S)
        self._renew = client.register_script(_RENEW)
        self._requeue = client.register_script(_REQUEUE)
        self._heartbeat = client.register_script(_HEARTBEAT)

    # --- coordinator ---------------------------------------------------------------------
    def take(
        self, count: int, reports_of: str | None = None, max_reports: int = 1000
    ) -> tuple[list[tuple[str, bytes]], list[dict[str, Any]]]:
        """Atomically move up to ``count`` requests (highest priority list first) into flight, and pop
        the batch reports waiting for coordinator ``reports_of`` (none if None): one round trip."""
        keys = [
            self.keys.inflight_lease,
            self.keys.inflight_raw,
            self.keys.reports_for(reports_of or ""),
            *self.keys.request_lists,
        ]
        flat, raw_reports = self._take(
            keys=keys, args=[count, self.lease_ms, max_reports if reports_of is not None else 0]
        )
        taken = [(_text(flat[i]), flat[i + 1]) for i in range(0, len(flat), 2)]
        return taken, [json.loads(r) for r in raw_reports]

    def dispatch(
        self,
        queue_list: str,
        batches: Sequence[tuple[str, Sequence[str], str | bytes]],
        events: tuple[str, bytes] | None = None,
    ) -> int:
        """Publish ``events`` (topic, raw), then for each (batch id, request ids, task message): record
        the batch as owner of its requests still in flight, renew their leases and LPUSH the message
        onto ``queue_list``. One script: atomic, one round trip. Returns the requests assigned."""
        topic, raw = events if events is not None else ("", b"")
        args: list[Any] = [self.lease_ms, topic, raw]
        for batch_id, ids, message in batches:
            args += [batch_id, len(ids), *ids, message]
        return int(
            self._dispatch(keys=[self.keys.inflight_lease, self.keys.inflight_owner, queue_list], args=args)
        )

    def renew_held(self, ids: Sequence[str]) -> int:
        """Renew leases of requests the coordinator holds or dispatched and no worker claimed yet."""
        if not ids:
            return 0
        return int(
            self._renew_held(
                keys=[self.keys.inflight_lease, self.keys.inflight_owner], args=[self.lease_ms, *ids]
            )
        )

    def requeue(self, ids: Sequence[str]) -> int:
        """Hand ``ids`` back to the front of the request queue now (shutdown)."""
        if not ids:
            return 0
        return int(self._requeue(keys=self._requeue_keys(), args=[0, *ids]))

    def reap(self, limit: int = 10_000) -> int:
        """Requeue requests whose holder stopped renewing their lease. Safe from any process."""
        return int(self._requeue(keys=self._requeue_keys(), args=[limit]))

    def _requeue_keys(self) -> list[str]:
        return [
            self.keys.inflight_lease,
            self.keys.inflight_raw,
            self.keys.inflight_owner,
            self.keys.request_queue,
        ]

    def dead_letter(self, request_id: str, raw: bytes, reason: str) -> None:
        """Move a message that is not a carpool request out of flight into the dead-letter list."""
        entry = json.dumps({"id": request_id, "reason": reason, "raw": raw.decode("utf-8", "replace")})
        with self.client.pipeline(transaction=True) as pipe:
            pipe.lpush(self.keys.dead_letter, entry)
            pipe.ltrim(self.keys.dead_letter, 0, 9999)
            self._ack_into(pipe, [request_id])
            pipe.execute()

    # --- worker ---------------------------------------------------------------------------
    def claim(self, batch_id: str, ids: Sequence[str]) -> list[bool]:
        """Which of ``ids`` this batch still owns; marks them claimed so only the worker renews them."""
        if not ids:
            return []
        flags = self._claim(
            keys=[self.keys.inflight_lease, self.keys.inflight_owner], args=[batch_id, self.lease_ms, *ids]
        )
        return [bool(int(f)) for f in flags]

    def claim_fresh(
        self, batch_id: str, ids: Sequence[str], result_keys: Sequence[str], results_db: int
    ) -> list[int]:
        """:meth:`claim` and a check for stored results in one round trip: per id 0 (not this
        batch's), 1 (claimed, to run) or 2 (claimed, already answered). ``result_keys[i]`` is the
        result key of ``ids[i]`` in database ``results_db`` of this same Redis server."""
        if not ids:
            return []
        flags = self._claim_fresh(
            keys=[self.keys.inflight_lease, self.keys.inflight_owner, *result_keys],
            args=[batch_id, self.lease_ms, results_db, *ids],
        )
        return [int(f) for f in flags]

    def finish(
        self,
        *,
        results_db: int,
        broker_db: int,
        result_keys: Sequence[str],
        results: Sequence[bytes],
        expires_s: int,
        ack_ids: Sequence[str],
        report: dict[str, Any] | None,
        coordinator: str,
        events: tuple[str, bytes] | None,
    ) -> list[int]:
        """Store results write-once (publishing each), acknowledge ``ack_ids``, push the report and
        publish ``events`` (topic, raw): one script, one round trip. Results live in database
        ``results_db`` of this server. Returns the 1-based indexes of the results stored."""
        topic, raw = events if events is not None else ("", b"")
        keys = [
            self.keys.inflight_lease,
            self.keys.inflight_raw,
            self.keys.inflight_owner,
            self.keys.reports_for(coordinator),
            *result_keys,
        ]
        args: list[Any] = [
            results_db,
            broker_db,
            expires_s,
            json.dumps(report) if report is not None else "",
            topic,
            raw,
            len(results),
            *results,
            *ack_ids,
        ]
        return [int(i) for i in self._finish(keys=keys, args=args)]

    def renew_running(self, ids: Sequence[str]) -> None:
        if ids:
            self._renew(keys=[self.keys.inflight_lease], args=[self.lease_ms, *ids])

    def ack(self, ids: Sequence[str], report: dict[str, Any] | None = None, coordinator: str = "") -> None:
        """Forget answered requests, and send the batch report to its coordinator, in one trip."""
        with self.client.pipeline(transaction=False) as pipe:
            self.ack_into(pipe, ids, report, coordinator)
            pipe.execute()

    def ack_into(
        self, pipe: Any, ids: Sequence[str], report: dict[str, Any] | None = None, coordinator: str = ""
    ) -> None:
        """Queue :meth:`ack`'s commands on ``pipe`` (the caller adds its own and executes)."""
        self._ack_into(pipe, ids)
        if report is not None:
            key = self.keys.reports_for(coordinator)
            pipe.lpush(key, json.dumps(report))
            pipe.ltrim(key, 0, 9_999)
            pipe.expire(key, REPORTS_TTL_S)  # a dead coordinator's reports do not pile up

    def _ack_into(self, pipe: Any, ids: Sequence[str]) -> None:
        if ids:
            pipe.zrem(self.keys.inflight_lease, *ids)
            pipe.hdel(self.keys.inflight_raw, *ids)
            pipe.hdel(self.keys.inflight_owner, *ids)

    def heartbeat(self, hostname: str, ttl_s: float) -> int:
        return int(self._heartbeat(keys=[self.keys.workers], args=[hostname, int(ttl_s * 1000)]))

    def live_workers(self) -> int:
        return int(self._heartbeat(keys=[self.keys.workers], args=["", 0]))

    def leave(self, hostname: str) -> None:
        self.client.zrem(self.keys.workers, hostname)

    def pop_reports(self, coordinator: str, count: int = 1000) -> list[dict[str, Any]]:
        raw = self.client.rpop(self.keys.reports_for(coordinator), count)
        return [json.loads(r) for r in raw or () if isinstance(r, bytes | str)]

    # --- introspection --------------------------------------------------------------------
    def queued(self) -> int:
        with self.client.pipeline(transaction=False) as pipe:
            for key in self.keys.request_lists:
                pipe.llen(key)
            return sum(pipe.execute())

    def in_flight(self) -> int:
        return int(self.client.zcard(self.keys.inflight_lease))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
