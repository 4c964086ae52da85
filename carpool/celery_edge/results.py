"""carpool's result backend: Celery's Redis backend with prompt ``.get()`` and bulk, write-once stores.

Its result consumer, :class:`~carpool.celery_edge.result_consumer.PromptResultConsumer`, returns
from ``.get()`` at once when the result is already known, and lets producers (un)subscribe in bulk.

Workers and the coordinator store many results at once with :meth:`CarpoolRedisBackend.store_many`:
one script call per batch that SETs each result only if none is stored yet (a second run of the
same request never overwrites the first answer) and PUBLISHes it to wake waiting producers; those
stored for a producer with a result inbox (:mod:`carpool.celery_edge.inbox`) are published there
too, one message per inbox.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from celery import states
from celery.backends.redis import RedisBackend, SentinelBackend
from celery.exceptions import TaskRevokedError
from kombu.exceptions import EncodeError
from kombu.serialization import loads
from kombu.utils.json import dumps as kombu_dumps

from carpool.celery_edge.compat import result_meta, service_process, traceback_of
from carpool.celery_edge.result_consumer import PromptResultConsumer
from carpool.codec import (
    brief,
    dumps_plain,
    dumps_result,
    dumps_results,
    kombu_json,
    packb_plain,
    packb_result,
    packb_results,
    unpackb,
)
from carpool.codec import loads as json_loads
from carpool.errors import CarpoolError, ModelError, described
from carpool.names import INBOX_CHANNEL
from carpool.redis_edge import lua
from carpool.redis_edge.store import ResultWrites, finish_call

log = logging.getLogger(__name__)


class CarpoolRedisBackend(RedisBackend):  # type: ignore[misc]  # Celery is untyped
    """Redis result backend used by the carpool Celery app (see module docstring)."""

    ResultConsumer = PromptResultConsumer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # RESP2 unless the URL asks otherwise. redis-py 8 speaks RESP3 by default, where every pub/sub
        # message is a push reply whose handler formats the whole message for a debug log line even
        # when debug is off: for a 7 KB embedding that costs more than decoding the result.
        self.connparams.setdefault("protocol", 2)
        self._store_once = lua.register(self.client, "finish")  # the write-once rule lives there
        self._thread = threading.get_ident()

    def _of_this_thread(self) -> Any:
        """The calling thread's backend (Celery's app makes one per thread): an AsyncResult keeps
        the backend of the thread that made it, and a result consumer's pub/sub connection serves
        one thread at a time, so a ``.get()`` from another thread waits on that thread's own."""
        if threading.get_ident() == self._thread:
            return self
        here = self.app.backend
        return here if isinstance(here, CarpoolRedisBackend) else self

    def add_pending_result(self, result: Any, *args: Any, **kwargs: Any) -> Any:
        if service_process():  # nothing here waits on a result: no subscription (a group's barrier)
            return result
        here = self._of_this_thread()
        if here is not self:
            return here.add_pending_result(result, *args, **kwargs)
        return super().add_pending_result(result, *args, **kwargs)

    def remove_pending_result(self, result: Any) -> Any:
        """Celery's, here and in the calling thread's backend, where a ``.get()`` from that thread
        registered ``result`` (a settled result's entry would otherwise stay there for good)."""
        here = self._of_this_thread()
        if here is not self:
            here.remove_pending_result(result)
        return super().remove_pending_result(result)

    def iter_native(self, result: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """Celery's join of a result set (``ResultSet.get``, ``join_native``), with its unsettled
        members registered here first: this is the joining thread's backend, and members sent or
        gathered into the set in another thread were registered in that thread's, so this
        thread's consumer would drop their messages."""
        for node in getattr(result, "results", None) or ():
            if hasattr(node, "_cache") and not node._cache:
                self.add_pending_result(node)
        yield from super().iter_native(result, *args, **kwargs)

    def wait_for_pending(self, result: Any, *args: Any, **kwargs: Any) -> Any:
        here = self._of_this_thread()
        if here is not self:
            return here.wait_for_pending(result, *args, **kwargs)
        return super().wait_for_pending(result, *args, **kwargs)

    def get_key_for_task(self, task_id: Any, key: Any = "") -> Any:
        """Celery's key (``<global prefix>celery-task-meta-<id>``), built without its generic joins:
        gather and the worker compute thousands per second."""
        prefix = self.task_keyprefix
        if type(task_id) is str and task_id and not key and type(prefix) is bytes:
            return prefix + task_id.encode()
        return super().get_key_for_task(task_id, key)

    def decode(self, payload: Any) -> Any:
        """A stored or published result meta, decoded, whichever of json and msgpack wrote it (a
        JSON meta starts with "{", a msgpack one with a map's type byte, never "{"): a process
        reads results stored under either ``CARPOOL_RESULT_SERIALIZER``. Plain JSON goes through
        orjson, msgpack through msgpack's C reader; JSON with kombu's type tags through kombu."""
        if type(payload) is bytes and payload:
            if payload[0] != 0x7B:  # "{"
                if payload[0] in _MSGPACK_MAPS:
                    try:
                        return unpackb(payload)
                    except ValueError:
                        pass  # not msgpack after all: kombu decides, as before
            # A tag is an object inside the meta: with no second "{" (a vector's meta) there is none.
            elif payload.find(b"{", 1) == -1 or b'"__type__"' not in payload:
                try:
                    return json_loads(payload)
                except ValueError:
                    pass  # not JSON after all: kombu raises its DecodeError, as before
            elif self.content_type != "application/json":
                return loads(payload, "application/json", "utf-8", accept=self.accept)  # type: ignore[no-untyped-call]  # kombu is untyped
        return super().decode(payload)

    def meta_for(self, task_id: str, state: str, result: Any, date_done: str | None = None) -> bytes:
        """Encoded result meta, as Celery's own ``store_result`` would write it.

        A success is encoded directly (the five fields of Celery's result meta plus the task id, with
        ``date_done`` computed once per batch by :meth:`store_args`; the result by
        :func:`carpool.codec.dumps_result` when it is plain JSON or a model's numpy row), because
        Celery's general path costs several times the encoding itself. Failures (rare) take Celery's
        path, which knows how to serialise exceptions.
        """
        direct = _DIRECT.get(self.serializer)
        if state == SUCCESS and date_done is not None and direct is not None:
            encode, _, join, encode_plain, null = direct
            encoded = encode(result)
            if encoded is not None:  # else not plain JSON or msgpack: Celery's encoder decides
                return join(encoded, encode_plain(date_done) or null, task_id)
        # A raised exception's traceback, as Celery stores it (not carpool's own refusals': they say why).
        tb = (
            traceback_of(result)
            if isinstance(result, BaseException) and not isinstance(result, CarpoolError)
            else None
        )
        meta = result_meta(self, self.encode_result(result, state), state, tb)
        meta["task_id"] = task_id
        encoded = self.encode(meta)
        return encoded if isinstance(encoded, bytes) else encoded.encode("utf-8")

    def mark_as_revoked(
        self,
        task_id: str,
        reason: str = "",
        request: Any = None,
        store_result: bool = True,
        state: str = states.REVOKED,
    ) -> None:
        """Celery's ``mark_as_revoked``, its meta stored write-once and as JSON. Every worker that
        hears a revoke broadcast calls this for each id named, and Celery's store would overwrite
        whatever answer the request had, once per worker; and the ids may be another Celery app's
        on this Redis, which reads its results as JSON."""
        exc = TaskRevokedError(reason)
        if store_result:
            meta = result_meta(self, self.encode_result(exc, state), state)
            meta["task_id"] = task_id
            payload = kombu_dumps(meta).encode("utf-8")  # type: ignore[no-untyped-call]  # kombu is untyped
            self.store_encoded(ResultWrites([self.get_key_for_task(task_id)], [payload], self.expiry_s))
        if request is not None and request.chord:
            self.on_chord_part_return(request, state, exc)

    @property
    def expiry_s(self) -> int:
        """How long a stored result lives, in seconds; 0 for ever, as Celery's Redis backend stores
        with ``result_expires=None`` (or 0)."""
        return int(self.expires) if self.expires else 0

    @property
    def inbox_prefix(self) -> bytes:
        """What every result inbox channel's name starts with."""
        prefix = self.task_keyprefix
        return (prefix if isinstance(prefix, bytes) else prefix.encode()) + INBOX_CHANNEL.encode()

    def store_args(
        self, entries: Sequence[tuple[str, str, Any]], inboxes: Mapping[str, str] | None = None
    ) -> ResultWrites:
        """What to store, write-once, for (task_id, state, result-or-exception) triples; ``inboxes``:
        the result inbox channel of the task ids whose producer named one.

        A success the result serializer cannot encode (a model's output holding a UUID under msgpack,
        say) is stored as that request's failure, naming the type and what to return instead, and
        becomes that failure in ``entries`` too when it is a list, so that what the caller does
        next (task events, links) agrees with what is stored; the batch's other results are stored
        as they are."""
        expiry_s = self.expiry_s
        if not entries:
            return ResultWrites((), (), expiry_s)
        date_done = self.app.now().isoformat()
        direct = _DIRECT.get(self.serializer)
        encodings: Sequence[bytes | None] = ()
        if direct is not None:
            _, encode_many, join, encode_plain, null = direct
            done = encode_plain(date_done) or null
            encodings = encode_many([result if state == SUCCESS else None for _, state, result in entries])
        keys = [self.get_key_for_task(task_id) for task_id, _, _ in entries]
        payloads = []
        for index, (task_id, state, _) in enumerate(entries):  # meta_for's direct path inlined
            encoded = encodings[index] if direct is not None and state == SUCCESS else None
            if encoded is None:
                payloads.append(self._meta_or_refusal(entries, index, date_done))
            else:
                payloads.append(join(encoded, done, task_id))
        if not inboxes:
            return ResultWrites(keys, payloads, expiry_s)
        boxes = [inboxes.get(task_id, "") for task_id, _, _ in entries]
        return ResultWrites(keys, payloads, expiry_s, boxes, self.inbox_prefix)

    def _meta_or_refusal(self, entries: Sequence[tuple[str, str, Any]], index: int, date_done: str) -> bytes:
        """The meta of ``entries[index]``; a success the serializer cannot encode becomes a failure."""
        task_id, state, result = entries[index]
        # Under msgpack a success gets here only when packb_result found no form a reader takes.
        reason = "no msgpack form, or a map key other than a string" if self.serializer == "msgpack" else None
        if state != SUCCESS or reason is None:
            try:
                meta = self.meta_for(task_id, state, result, date_done)
                if self.serializer == "msgpack" and state != SUCCESS:
                    # msgpack packs an exception's argument holding a map key other than a string
                    # ({1: "a"}), which no reader unpacks: .get() and .state raised DecodeError.
                    unpackb(meta)
                return meta
            except (EncodeError, TypeError, ValueError, OverflowError) as exc:
                if state != SUCCESS:
                    # Celery makes an exception's arguments serializable; whatever else defeats the
                    # encoder fails this request alone, named, never the batch's store.
                    log.warning("request %s: its failure could not be stored as raised: %s", task_id, exc)
                    error = ModelError(
                        described(result) if isinstance(result, BaseException) else str(result)
                    )
                    if isinstance(entries, list):
                        entries[index] = (task_id, FAILURE, error)
                    return self.meta_for(task_id, FAILURE, error, date_done)
                reason = str(exc)
        # JSON is worth naming only where Celery's JSON would store the value (it tags a UUID).
        instead = "; or store results as JSON (CARPOOL_RESULT_SERIALIZER=json)" if kombu_json(result) else ""
        error = ModelError(
            f"result {type(result).__name__} {brief(result)} cannot be stored as {self.serializer} "
            f"({reason}); a model's forward must return JSON values (lists, dicts with string keys, "
            f"strings, finite numbers) or a numpy array with one row per request{instead}"
        )
        log.warning("request %s: %s", task_id, error)
        if isinstance(entries, list):
            entries[index] = (task_id, FAILURE, error)
        return self.meta_for(task_id, FAILURE, error, date_done)

    def store_many(
        self,
        entries: Iterable[tuple[str, str, Any]],
        client: Any = None,
        inboxes: Mapping[str, str] | None = None,
    ) -> Any:
        """Store (task_id, state, result-or-exception) triples; return the ids actually stored.

        A task id that already has a result keeps it: at-least-once execution, one answer. With
        ``client`` a pipeline, the script is queued on it and the pipeline is returned instead
        (``execute()`` then gives the 1-based indexes of the entries stored). ``inboxes``: see
        :meth:`store_args`, which also says what becomes of a success that cannot be encoded (here
        the caller's entries stay as they were).
        """
        entries = list(entries)
        if not entries:
            return [] if client is None else client
        stored = self.store_encoded(self.store_args(entries, inboxes), client)
        return stored if client is not None else [entries[i - 1][0] for i in stored]

    def store_encoded(self, writes: ResultWrites, client: Any = None) -> Any:
        """Store what :meth:`store_args` gave, write-once; the 1-based indexes of the results stored
        (with ``client`` a pipeline: the script is queued on it and the pipeline returned)."""
        keys, args = finish_call(writes)
        if client is not None:
            return self._store_once(keys=keys, args=args, client=client)
        return [int(i) for i in self._store_once(keys=keys, args=args)]

    def existing(self, task_ids: Sequence[str]) -> set[str]:
        """The ids among ``task_ids`` that already have a stored result."""
        if not task_ids:
            return set()
        found = self.client.mget([self.get_key_for_task(t) for t in task_ids])
        return {t for t, v in zip(task_ids, found, strict=True) if v is not None}


def success_meta(result: bytes, date_done: bytes, task_id: str) -> bytes:
    """Celery's result meta of a success, encoded: the bytes ``orjson.dumps`` gives for the dict
    ``{"status": "SUCCESS", "result": ..., "traceback": None, "children": [], "date_done": ...,
    "task_id": ...}``, joined around the encoded result instead of encoding a dict holding it."""
    task_id_json = dumps_plain(task_id) or b"null"
    return b"".join((_SUCCESS_HEAD, result, _SUCCESS_MIDDLE, date_done, _SUCCESS_TAIL, task_id_json, b"}"))


_SUCCESS_HEAD = b'{"status":"SUCCESS","result":'
_SUCCESS_MIDDLE = b',"traceback":null,"children":[],"date_done":'
_SUCCESS_TAIL = b',"task_id":'


def success_msgpack(result: bytes, date_done: bytes, task_id: str) -> bytes:
    """:func:`success_meta` in msgpack: the bytes ``msgpack.packb`` gives for the same dict, joined
    around the packed result (and the packed ``date_done``)."""
    return b"".join(
        (_PACKED_HEAD, result, _PACKED_MIDDLE, date_done, _PACKED_TAIL, packb_plain(task_id) or b"\xc0")
    )


def success_row(payload: bytes) -> dict[str, Any] | None:
    """The meta :func:`success_msgpack` wrote around a packed numeric row (a model's float32 or
    float64 vector), with its ``result`` a numpy array of the row's exact values, read from the bytes
    without making a Python float of each; None for any other payload (decode it as usual)."""
    head = len(_PACKED_HEAD)
    if not payload.startswith(_PACKED_HEAD) or len(payload) < head + 6:
        return None
    tag = payload[head]
    if 0x91 <= tag <= 0x9F:  # fixarray
        count, at = tag & 0x0F, head + 1
    elif tag in _ARRAY_LENGTH_BYTES:  # array 16, array 32
        size = _ARRAY_LENGTH_BYTES[tag]
        count, at = int.from_bytes(payload[head + 1 : head + 1 + size], "big"), head + 1 + size
    else:
        return None
    cell = _ROW_CELLS.get(payload[at])  # within the payload: it holds at least head + 6 bytes
    if cell is None or count == 0:
        return None
    width, stored, native = cell
    end = at + count * width
    # Every element the same msgpack float type (a bytes comparison, in C), then the meta around it.
    if not payload.startswith(_PACKED_MIDDLE, end) or payload[at:end:width] != payload[at : at + 1] * count:
        return None
    try:
        meta: dict[str, Any] = unpackb(b"".join((_PACKED_HEAD, b"\xc0", payload[end:])))
    except ValueError:
        return None
    if len(meta) != 6:  # a key repeated after the row would replace what it read
        return None
    values = _numpy().ndarray((count,), dtype=stored, buffer=payload, offset=at + 1, strides=(width,))
    meta["result"] = values.astype(native)
    return meta


def _numpy() -> Any:
    import numpy  # only the readers of rows need it: a producer install may lack it

    return numpy


# msgpack's float32 and float64 type bytes -> (bytes per array element, the value's dtype as stored:
# big-endian, the dtype it is read into: this machine's order), as numpy type names.
_ROW_CELLS = {0xCA: (5, ">f4", "=f4"), 0xCB: (9, ">f8", "=f8")}
_ARRAY_LENGTH_BYTES = {0xDC: 2, 0xDD: 4}  # msgpack array 16 and array 32: bytes of their length


def _packed(*items: Any) -> bytes:
    return b"".join(packb_plain(item) or b"\xc0" for item in items)


_PACKED_HEAD = b"\x86" + _packed("status", "SUCCESS", "result")  # a map of six
_PACKED_MIDDLE = _packed("traceback", None, "children", [], "date_done")
_PACKED_TAIL = _packed("task_id")
_MSGPACK_MAPS = frozenset({*range(0x80, 0x90), 0xDE, 0xDF})  # fixmap, map 16, map 32

_Encode = Callable[[Any], bytes | None]
_EncodeMany = Callable[[Sequence[Any]], Sequence[bytes | None]]
# The serializers carpool writes success metas for itself: the result's encoder (None: not plain),
# the same for a batch's results, the meta joined around it, the encoder of date_done, and that
# encoding's null.
_DIRECT: dict[str, tuple[_Encode, _EncodeMany, Callable[[bytes, bytes, str], bytes], _Encode, bytes]] = {
    "json": (dumps_result, dumps_results, success_meta, dumps_plain, b"null"),
    "msgpack": (packb_result, packb_results, success_msgpack, packb_plain, b"\xc0"),
}


class CarpoolSentinelBackend(CarpoolRedisBackend, SentinelBackend):  # type: ignore[misc]
    """:class:`CarpoolRedisBackend` on the master a Redis Sentinel names (a ``sentinel://`` URL,
    ``CARPOOL_SENTINEL_MASTER``): Celery's Sentinel backend finds the master, carpool's adds the rest."""


SUCCESS = states.SUCCESS
FAILURE = states.FAILURE
REVOKED = states.REVOKED
