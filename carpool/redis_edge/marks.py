"""Which batches a worker is running, so that a worker's death is counted against the requests it
died running, not every request it had claimed.

A worker claims batches ahead of its device (one waiting in its device stage) and stores results
behind it (up to three in its finisher). When it dies, every one of those requests comes back
through lease recovery, but only the batch on the device, or the one whose results it was encoding
and storing (a result too large for its memory), can have killed it. So the worker marks a batch
just before the device runs it, unmarks it while it waits for the finisher, marks it again while its
results are stored, and unmarks it once they are (``Keys.inflight_running``); the reap
(``requeue.lua``) counts a death only for a request whose batch is marked.

A mark is sent and not waited for: its round trip would add to every batch's time on the device.
What was sent reaches Redis even when the process dies right after (the kernel sends what it was
given). An unmark is not urgent (sent late, a death meanwhile counts one batch more): it goes with
the next mark, in the same write, or with the heartbeat's :meth:`DeviceMarks.flush`, so that a
batch costs one or two writes, not four. A mark lost to a connection error only means that a
death is not counted, as before deaths were counted: the batch comes back batched again. An unmark
lost so leaves its batch marked a day, which counts nothing once its requests are answered.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import redis

from carpool.redis_edge.lua import pack_command
from carpool.redis_edge.store import refused_by_acl

log = logging.getLogger(__name__)

# After a failed send, marks are dropped for this long before the connection is tried again: a
# device thread waits on no connection attempt per batch while Redis is unreachable.
RETRY_AFTER_S = 1.0


class DeviceMarks:
    """A worker's marks of the batches it runs, sent on a connection of their own (from
    ``client``'s pool), from whichever thread starts, stores or ends a batch."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        self.client = client
        self.key = key
        self._lock = threading.Lock()
        self._conn: Any = None
        self._pid = 0
        self._unread = 0  # replies sent for and not read back yet
        self._retry_at = 0.0  # monotonic time before which marks are dropped (after a failure)
        self._failing = False  # marks are being lost (logged once until one is sent again)
        self._refused = False  # Redis refused a mark (logged once until one is taken again)
        self._ends: list[str] = []  # unmarks not sent yet

    def check(self) -> None:
        """Send an unmark of no batch and wait for its reply: an ACL that refuses the marks (rules
        older than this release) raises its ``ResponseError`` at the worker's start, not later."""
        self.client.zrem(self.key, "")

    def begin(self, batch_id: str) -> None:
        """Mark ``batch_id`` running (on the device, or its results being stored), with when (ms,
        this host's clock: the reap drops marks a day old, which only a worker that died between
        its mark and its unmark leaves)."""
        mark = pack_command(("ZADD", self.key, int(time.time() * 1000), batch_id))
        with self._lock:
            if batch_id in self._ends:  # marked again before its unmark left (its results' store)
                self._ends.remove(batch_id)
            self._send(self._with_ends(mark))

    def end(self, batch_id: str) -> None:
        """Unmark ``batch_id`` (it can no longer kill this worker: run, or stored), with the next
        mark or :meth:`flush`."""
        with self._lock:
            self._ends.append(batch_id)

    def flush(self) -> None:
        """Send the unmarks not sent yet (the heartbeat's, once a second)."""
        with self._lock:
            if self._ends:
                self._send(self._with_ends(b""))

    def _with_ends(self, packed: bytes) -> tuple[bytes, int]:
        """``packed`` (one command, or none), after the unmarks not sent yet; and how many commands."""
        if not self._ends:
            return packed, 1
        ends, self._ends = self._ends, []
        return pack_command(("ZREM", self.key, *ends)) + packed, 1 + bool(packed)

    def close(self) -> None:
        self.flush()
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.disconnect()
                self.client.connection_pool.release(self._conn)
            self._conn = None

    def _send(self, commands: tuple[bytes, int]) -> None:
        """Write ``commands`` (packed, and how many); call under the lock."""
        packed, count = commands
        if self._failing and time.monotonic() < self._retry_at:
            return
        for attempt in range(2):
            try:
                conn = self._connection()
                # Reading what arrived also finds a connection the server closed (a restart,
                # CLIENT KILL, an idle timeout) before a mark is written to it and lost.
                self._read_back(conn)
                # No health check: its PING's reply would be read in place of an unread mark's.
                conn.send_packed_command((packed,), check_health=False)
                self._unread += count
                if self._failing:
                    log.info("marking running batches works again")
                    self._failing = False
                return
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if self._conn is not None:
                    self._conn.disconnect()
                self._unread = 0
                if attempt:
                    self._retry_at = time.monotonic() + RETRY_AFTER_S
                    if not self._failing:
                        log.warning(
                            "could not mark a batch running or done (%s); until this"
                            " works, a batch that kills this worker is not counted against its"
                            " requests",
                            exc,
                        )
                        self._failing = True

    def _connection(self) -> Any:
        """The marks' connection, taken from the pool on first use (again in a forked process);
        under Sentinel, moved to the master named now once the pool would drop it. A connection
        that failed is connected again by its next send."""
        pool = self.client.connection_pool
        if self._conn is None or self._pid != os.getpid():
            self._conn, self._pid, self._unread = pool.get_connection(), os.getpid(), 0
        elif not pool.owns_connection(self._conn):
            self._conn.disconnect()
            self._conn.connect()
            self._unread = 0
        return self._conn

    def _read_back(self, conn: Any) -> None:
        """Read the replies that have arrived (a refusal is logged once); raises ``ConnectionError``
        on a connection the server closed."""
        while conn.can_read(timeout=0):  # a closed connection raises
            if not self._unread:
                raise redis.ConnectionError("a reply that no mark asked for")
            self._unread -= 1
            try:
                conn.read_response()
                self._refused = False  # a later refusal is logged again
            except redis.ResponseError as exc:
                if not self._refused:
                    mend = (
                        " Regenerate the worker's Redis rules with `carpool acl --role worker` and load"
                        " them into Redis."
                        if refused_by_acl(exc)
                        else ""
                    )
                    log.error(
                        "Redis refused to mark a running batch (%s): until it takes them, a batch"
                        " that kills this worker is not counted against its requests.%s",
                        exc,
                        mend,
                    )
                    self._refused = True
