"""JSON on the hot paths: orjson where its output means the same as the standard library's.

Every request is decoded by the coordinator and every result, task event and batch report is
encoded once per request; with ``json`` those calls are the largest single cost per request after
the Redis round trips, and orjson does both several times faster. Two things differ, and both are
kept out:

- orjson rejects what ``json.loads`` accepts beyond strict JSON (lone surrogate escapes, ``NaN``),
  and reads an integer past 64 bits (below -2**63 or above 2**64 - 1) as a float. :func:`loads`
  then decodes with ``json.loads``, so a message that decoded before still decodes the same, and
  validation names what is wrong with its values (an integer is never silently a float). Whether a
  text may hold such an integer is one C-level pass over its bytes (a run of 19 digits that no
  ``.`` precedes), which costs about as much as orjson's own parse again (docs/PERFORMANCE.md,
  "2026-12-05, later"); a result meta stored by msgpack, the default, never comes here.
- orjson encodes natively some types that kombu's JSON encoder tags (``datetime``, dataclasses,
  subclasses of builtins, numpy values). :func:`dumps_plain` refuses those (returns None) and the
  caller takes its usual path; it is meant for values made of dicts, lists, strings and numbers
  (model outputs, result metas). ``uuid.UUID`` is the exception orjson cannot be told to refuse: it
  becomes its string, so callers holding arbitrary user values check them first
  (:func:`flat_plain`, and :func:`dumps_result` for a task's output); an ``Enum`` member becomes its
  value. A non-finite float, which the
  standard library writes as the non-JSON ``NaN``, becomes ``null`` (as in JavaScript's
  ``JSON.stringify``).

A model's outputs may be a numpy array (one row per request): :func:`dumps_result` writes a row
straight from it, with no Python floats in between. A float32 value is written in the shortest form
that reads back as the same float32 (about half the characters of the float64 it would become as a
Python float): the float a reader parses from it equals the model's value once cast to float32,
exactly. float64 values are written as Python writes them, so they read back unchanged.

Results are msgpack by default (``CARPOOL_RESULT_SERIALIZER``): :func:`packb_result` writes a float
row as msgpack floats of the array's own width, straight from the array (ormsgpack), so a reader
gets the model's float32 values exactly (what ``row.tolist()`` gives) for a tenth of the CPU that
formatting decimals costs and about 40% of the bytes. Anything else goes through ``msgpack.packb``
as kombu's msgpack serializer would write it. A non-finite float in a numpy row becomes ``None``
there too, so a row reads the same under either serializer but for the digits of its floats.
"""

from __future__ import annotations

import enum
import functools
import json
import math
import numbers
import re
import reprlib
import sys
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import orjson

from carpool.errors import described

_PLAIN = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_SUBCLASS


def loads(data: bytes | str) -> Any:
    """``json.loads(data)``, faster for strict JSON (what every Celery producer writes)."""
    # An integer past 64 bits, which orjson would read as a float: :func:`long_int_in`, inlined for
    # bytes (every request's body comes here).
    if type(data) is bytes:
        if data.translate(_DIGITS).find(_RUN) >= 0 and _LONG_INT.search(data) is not None:
            return json.loads(data)
    elif long_int_in(data):
        return json.loads(data)
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def loads_numbers_loosely(data: bytes | str) -> Any:
    """:func:`loads`, except that an integer past 64 bits may become a float: for JSON whose numbers
    are only read, never passed on (a Celery message's envelope, whose headers' numbers are a
    priority, a timestamp, an eta), to spare its scan."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def long_int_in(data: bytes | str) -> bool:
    """Whether the JSON text ``data`` may hold an integer orjson reads as a float (one past 64 bits:
    19 digits or more); false positives (a long run of digits inside a string) only cost a slower
    decoding. Not for other types (orjson's memoryview, say), which are taken as holding none."""
    if type(data) is str:
        data = data.encode("utf-8", "surrogatepass")
    elif type(data) is not bytes:
        return False
    # One C-level pass and a search (bytes.find: faster than "in"), then a regular expression for the
    # rare text that has such a run, which tells an integer's digits from a fraction's.
    if data.translate(_DIGITS).find(_RUN) < 0:
        return False
    return _LONG_INT.search(data) is not None


_DIGITS = bytes(ord("d") if ord("0") <= c <= ord("9") else ord(" ") for c in range(256))
_RUN = b"d" * 19  # -2**63 has 19 digits, 2**64 - 1 has 20: orjson reads anything past them as a float
_LONG_INT = re.compile(rb"(?<![.0-9])[0-9]{19}")  # an integer's digits, not a fraction's (a float's)


def loads_tagged(data: Any) -> Any:
    """``kombu.utils.json.loads(data)`` (kombu's type tags, such as a datetime's, become their
    values), through orjson when ``data`` holds no tag: a worker decodes every batch message's body
    twice, and kombu's decoder calls a Python hook per JSON object. kombu decodes a text naming
    ``links`` that may hold an integer past 64 bits, which orjson would read as a float
    (:func:`long_int_in`): in a batch message only a request's links can hold one."""
    tag: bytes | str | None
    links: bytes | str | None
    if type(data) is bytes:
        tag, links = b'"__type__"', b'"links"'
    elif type(data) is str:
        tag, links = '"__type__"', '"links"'
    else:
        tag = links = None
    # Only a request's links can bring an integer past 64 bits into a batch message (the coordinator
    # refuses an item holding one), so only a text naming links is scanned for one.
    if tag is not None and tag not in data and (links not in data or not long_int_in(data)):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass  # what orjson refuses and json accepts: kombu decides, as before
    from kombu.utils.json import loads as kombu_loads

    return kombu_loads(data)  # type: ignore[no-untyped-call]  # kombu is untyped


def kombu_tags(value: Any) -> list[tuple[dict[str, Any], Any]]:
    """Each dict in ``value`` that kombu's JSON decoding takes for one of its type tags (its keys
    exactly ``__type__`` and ``__value__``), outermost first, with what that decoding makes of it:
    a value (bytes, a datetime, a UUID, a Decimal...) or the exception it raises (an unknown type, a
    value its type does not parse). A tag inside another is decoded with it, not listed again."""
    found: list[tuple[dict[str, Any], Any]] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is dict:
            if len(item) == 2 and "__type__" in item and "__value__" in item:
                found.append((item, _kombu_decoded(item)))
            else:
                stack.extend(reversed(item.values()))
        elif type(item) is list or type(item) is tuple:
            stack.extend(reversed(item))
    return found


def tag_failure(tag: dict[str, Any], exc: Exception) -> str:
    """Why kombu's JSON decoding fails on ``tag`` (``exc``, as :func:`kombu_tags` gave it), in words."""
    if isinstance(exc, ValueError) and exc.args[:1] == ("Unsupported type",):
        return f"it knows no type {brief(tag.get('__type__'))}"
    return described(exc)[:160]


def _kombu_decoded(tag: dict[str, Any]) -> Any:
    """What kombu's JSON decoding makes of ``tag`` (inner tags first, as it decodes), or its exception."""
    from kombu.utils.json import dumps as kombu_dumps
    from kombu.utils.json import loads as kombu_loads

    try:
        return kombu_loads(kombu_dumps(tag))  # type: ignore[no-untyped-call]  # kombu is untyped
    except Exception as exc:
        return exc


def dumps_plain(value: Any) -> bytes | None:
    """Compact UTF-8 JSON of ``value`` if it is made of plain JSON types only, else None."""
    try:
        return orjson.dumps(value, option=_PLAIN)
    except TypeError:  # orjson.JSONEncodeError: a type kombu's encoder would tag, or a non-str key
        return None


def dumps_result(value: Any) -> bytes | None:
    """Compact UTF-8 JSON of a task's result: a numpy array of numbers written by orjson from the array
    itself (float32 in its shortest float32 form), anything else as :func:`dumps_plain` writes it."""
    numpy = sys.modules.get("numpy")  # a result can only be an array once numpy is imported
    if numpy is not None and type(value) is numpy.ndarray:
        if not native_numpy(value):
            return dumps_plain(value.tolist())  # float16 and the like: as the Python values they hold
        if not value.flags.c_contiguous:
            value = numpy.ascontiguousarray(value)
        encoded: bytes = orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
        return encoded
    plain = dumps_plain(value)
    # orjson writes a UUID as its text, where Celery's JSON tags it and its reader gets a UUID back:
    # a result whose JSON holds a UUID's text is searched for one, and one holding it is left to
    # Celery's encoder (None). The common result, numbers or text with no such string, costs a scan.
    if plain is not None and b'"' in plain and _UUID_TEXT.search(plain) and _holds_uuid(value):
        return None
    return plain


_UUID_TEXT = re.compile(rb'"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"')


def _holds_uuid(value: Any) -> bool:
    if isinstance(value, uuid.UUID):
        return True
    if isinstance(value, dict):
        return any(map(_holds_uuid, value.values()))
    if isinstance(value, list | tuple):
        return any(map(_holds_uuid, value))
    return False


def dumps_results(values: Sequence[Any]) -> list[bytes | None]:
    """:func:`dumps_result` of each value."""
    return [dumps_result(value) for value in values]


def packb_result(value: Any) -> bytes | None:
    """msgpack of a task's result, as kombu's msgpack serializer would decode it: a 1-D numpy array
    of finite floats in this machine's byte order written by ormsgpack from the array itself
    (float32 as msgpack float32), any other array as the values :func:`stored_form` gives, anything
    else as :func:`packb_plain` writes it."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and type(value) is numpy.ndarray:
        floats, packb, option = _row_packing(numpy)
        if value.ndim == 1 and value.dtype in floats and numpy.isfinite(value).all():
            try:
                packed: bytes = packb(value, option=option)
            except TypeError:  # not C-contiguous (a column, say), which ormsgpack refuses
                packed = packb(numpy.ascontiguousarray(value), option=option)
            return packed
        return packb_plain(stored_form(value, "msgpack"))
    return packb_plain(value)


def packb_results(values: Sequence[Any]) -> list[bytes | None]:
    """:func:`packb_result` of each value, a batch's rows checked finite together: one check over
    their values joined costs a fifth of a check per row, which costs more than packing the row."""
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return [packb_result(value) for value in values]
    floats, packb, option = _row_packing(numpy)
    is_row = [type(v) is numpy.ndarray and v.ndim == 1 and v.dtype in floats for v in values]
    rows = [v for v, row in zip(values, is_row, strict=True) if row]
    # Joined, float32 beside float64 rows become float64, which keeps each value finite or not.
    if len(rows) < 2 or not numpy.isfinite(numpy.concatenate(rows)).all():
        return [packb_result(value) for value in values]  # a NaN somewhere: each row on its own
    out: list[bytes | None] = []
    for value, row in zip(values, is_row, strict=True):
        if not row:
            out.append(packb_result(value))
            continue
        try:
            out.append(packb(value, option=option))
        except TypeError:  # not C-contiguous (a column, say), which ormsgpack refuses
            out.append(packb(numpy.ascontiguousarray(value), option=option))
    return out


@functools.cache
def float_row_dtypes(numpy: Any) -> tuple[Any, Any]:
    """The dtypes of the float rows carpool writes straight from the array: float32 and float64 in
    this machine's byte order."""
    return numpy.dtype("=f4"), numpy.dtype("=f8")


@functools.cache
def _row_packing(numpy: Any) -> tuple[tuple[Any, Any], Callable[..., bytes], int]:
    """The dtypes :func:`packb_result` packs straight from a row (:func:`float_row_dtypes`) and
    ormsgpack's packer with its numpy option, set up where a row is first packed: a producer never
    packs one, so never imports ormsgpack."""
    import ormsgpack

    return float_row_dtypes(numpy), ormsgpack.packb, ormsgpack.OPT_SERIALIZE_NUMPY


def packb_plain(value: Any) -> bytes | None:
    """msgpack of ``value`` as kombu's msgpack serializer writes it, if a reader gets the same value
    back (lists for tuples, as JSON gives too), else None: a type msgpack has no form for (a
    datetime, a UUID, say), or a map key other than a string anywhere in it, which every reader
    (kombu's included) refuses."""
    try:
        encoded: bytes = msgpack.packb(value, use_bin_type=True)
        if type(value) not in _SCALARS:
            msgpack.unpackb(encoded, raw=False)  # strict map keys: what a reader would refuse
    except (TypeError, ValueError, OverflowError):
        return None
    return encoded


def unpackb(data: bytes) -> Any:
    """A msgpack result meta, as kombu's msgpack serializer decodes it."""
    return msgpack.unpackb(data, raw=False)


def loads_result(data: bytes) -> Any:
    """A result meta as carpool writes it under either serializer (a JSON one starts with "{", a
    msgpack one with a map's type byte), without kombu's type tags."""
    return loads(data) if data[:1] == b"{" else unpackb(data)


def native_numpy(array: Any) -> bool:
    """Whether :func:`dumps_result` writes numpy ``array`` straight from its values (orjson's numpy
    types: integers, bools, float32 and float64, in this machine's byte order), not from the Python
    values ``tolist()`` gives."""
    dtype = array.dtype
    return (dtype.kind in "iub" or (dtype.kind == "f" and dtype.itemsize in (4, 8))) and dtype.isnative


def float32_rows(array: Any) -> list[Any]:
    """The rows of a float32 numpy ``array`` (one per request), to store as :func:`dumps_result` writes
    them; except that a row holding a value whose shortest float32 form would not read back as that
    float32 becomes its list of Python floats, which are written exactly.

    A reader parses a JSON number into a float64 and casts it to float32: two roundings, which give
    the other float32 when the decimal lies within a float64 rounding error of the midpoint between
    two float32s. A value from 1e-3 to 1e10 in magnitude never does (a decimal of at most 9
    significant digits there is provably farther from every midpoint: docs/PERFORMANCE.md, "Compact
    results"); the few values outside that range are checked, for the whole batch at once.
    """
    import numpy

    flat = array.reshape(-1)
    magnitude = numpy.abs(flat)
    outside = (magnitude < _F32_EXACT_FROM) | (magnitude >= _F32_EXACT_BELOW)
    outside &= numpy.isfinite(flat) & (flat != 0)  # JSON has no inf or nan; zero reads back as zero
    rows: list[Any] = list(array)
    where = numpy.flatnonzero(outside)
    if where.size:
        values = flat[where]
        read = numpy.array(orjson.loads(orjson.dumps(values, option=orjson.OPT_SERIALIZE_NUMPY)))
        wrong = where[read.astype(numpy.float32) != values]
        for i in set((wrong // max(1, flat.size // max(1, len(rows)))).tolist()):
            rows[i] = array[i].tolist()
    return rows


_F32_EXACT_FROM = 1e-3  # magnitudes from here ...
_F32_EXACT_BELOW = 1e10  # ... to here read back exactly in their shortest float32 form


def stored_form(value: Any, serializer: str = "json") -> Any:
    """``value`` as a reader of its result stored with ``serializer`` gets it back: a numpy array
    becomes the lists of Python numbers that :func:`dumps_result` writes (json), or its values with
    each non-finite float as None (msgpack); anything else is returned as it is."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and type(value) is numpy.ndarray:
        if serializer == "msgpack":
            if value.dtype.kind not in "fc" or numpy.isfinite(value).all():
                return value.tolist()
            return _finite_or_none(value.tolist())
        encoded = dumps_result(value)
        return value.tolist() if encoded is None else orjson.loads(encoded)
    return value


def read_back(value: Any, serializer: str = "json") -> Any:
    """``value`` (an output :func:`storable` passed) as ``.get()`` reads it back once stored with
    ``serializer``: lists for tuples, Python numbers for numpy's, a ``str`` for a subclass of it."""
    value = stored_form(value, serializer)
    if serializer == "msgpack":
        packed = packb_plain(value)
        return value if packed is None else msgpack.unpackb(packed, raw=False)
    from kombu.utils.json import dumps as kombu_dumps
    from kombu.utils.json import loads as kombu_loads

    return kombu_loads(kombu_dumps(value))  # type: ignore[no-untyped-call]  # kombu is untyped


def _finite_or_none(values: Any) -> Any:
    if type(values) is list:
        return [_finite_or_none(v) for v in values]
    return values if type(values) is not float or math.isfinite(values) else None


def flat_plain(args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any]) -> bool:
    """True when every argument is a str, int, float, bool or None (exact types): task arguments that
    :func:`dumps_plain` writes exactly as kombu would."""
    return all(type(v) in _SCALARS for v in args) and all(type(v) in _SCALARS for v in kwargs.values())


_SCALARS = frozenset({str, int, float, bool, type(None)})


def dumps_lenient(value: Any) -> bytes:
    """Compact UTF-8 JSON; what JSON cannot express is written as its ``str`` (telemetry: events)."""
    try:  # orjson's option for non-str keys slows every dict down, so only when one needs it
        return orjson.dumps(value, default=str)
    except TypeError:
        return orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS)


def dumps_exact(value: Any) -> bytes:
    """JSON of ``value`` that decodes back to an equal value, or raise ``TypeError``/``ValueError``
    saying why not: a type JSON lacks, a non-str key, an integer past 64 bits, a lone surrogate
    (``TypeError``), lists and dicts nested past :data:`MAX_DEPTH` (``TypeError``), or a non-finite
    float (``ValueError``)."""
    try:
        encoded: bytes = orjson.dumps(value, option=_PLAIN)
    except orjson.JSONEncodeError as exc:
        if str(exc) == "Recursion limit reached":
            raise TypeError(
                f"lists and dicts nested more than {MAX_DEPTH} levels deep, orjson's limit; nest them less"
            ) from None
        raise
    if not finite(value):
        raise ValueError(_NON_FINITE)
    return encoded


def crosses_as_another(value: Any) -> str | None:
    """What in ``value`` JSON would give back as another type, or None: a UUID as its text and an
    Enum member as its value (orjson writes both; kombu's JSON tags a UUID and decodes it back), a
    str, int or float subclass as the plain type, a numpy scalar as a Python number."""
    stack = [value]
    while stack:
        v = stack.pop()
        kind = type(v)
        if kind in _SCALARS:
            continue
        if isinstance(v, uuid.UUID):
            return f"a UUID ({v}) would reach the function as a str; pass str(v)"
        if isinstance(v, enum.Enum):
            return f"an Enum member ({v!r}) would reach the function as its value; pass v.value"
        if isinstance(v, str | int | float) or (kind.__module__ == "numpy" and isinstance(v, numbers.Number)):
            return (
                "it would reach the function as another type (a str or number subclass as the plain"
                " type, a numpy scalar as a Python number); convert it first: str(v), int(v), float(v)"
                " or v.item()"
            )
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)
    return None


_NON_FINITE = "a non-finite float (inf or nan), which JSON cannot write"
MAX_DEPTH = 254  # the deepest nesting of lists and dicts orjson writes


def finite(value: Any) -> bool:
    """No inf or nan anywhere in ``value``."""
    if isinstance(value, float):  # numpy's float64 too
        return math.isfinite(value)
    if isinstance(value, list | tuple):
        if all(type(v) is float for v in value):  # a vector: checked in one C-level pass
            return all(map(math.isfinite, value))
        return all(map(finite, value))
    if isinstance(value, dict):
        return all(map(finite, value.values()))
    return True


def _tag_refusal(task: str, value: Any) -> tuple[bool, Any]:
    """``(True, value)``, or the failure of an output holding a dict shaped like one of kombu's type
    tags: Celery's JSON results decode it as that type (or fail on it), so ``.get()`` would not
    return it, and a ``gather`` holding it would fail."""
    for tag, decoded in kombu_tags(value):
        becomes = (
            f"fails on it ({tag_failure(tag, decoded)})"
            if isinstance(decoded, Exception)
            else f"gives {brief(decoded)} ({type(decoded).__name__}) instead"
        )
        return False, TypeError(
            f"{task} returned {brief(value)}, which holds {brief(tag)}, a dict shaped like one of"
            f" kombu's type tags (its only keys __type__ and __value__): Celery's JSON results decode"
            f" it, so .get() {becomes}; rename the dict's keys, or store results as msgpack"
            " (CARPOOL_RESULT_SERIALIZER=msgpack, the default), which has no tags"
        )
    return True, value


def storable(task: str, outcomes: list[tuple[bool, Any]], serializer: str = "json") -> list[tuple[bool, Any]]:
    """Each successful output that JSON cannot carry to ``.get()`` unchanged becomes that request's
    failure (Celery's own tagged types, such as datetimes, are carried as Celery carries them with
    the json ``serializer``; with msgpack, which has no tags, those msgpack cannot carry fail too)."""
    out: list[tuple[bool, Any]] = []
    for ok, value in outcomes:
        if ok:
            try:
                encoded = dumps_exact(value)
                # orjson never escapes a key's letters: an exact first check, C-fast
                if serializer == "json" and encoded.find(b'"__type__"') >= 0:
                    ok, value = _tag_refusal(task, value)
            except ValueError as exc:
                ok, value = False, ValueError(f"{task} returned {brief(value)}: {exc}; return finite numbers")
            except TypeError as exc:
                if "64-bit" in str(exc) or not kombu_json(value):
                    ok, value = (
                        False,
                        TypeError(
                            f"{task} returned {type(value).__name__} {brief(value)}, which cannot be "
                            f"stored as JSON unchanged ({exc}); return lists, dicts with string keys, "
                            "strings, finite numbers and integers within 64 bits (e.g. array.tolist())"
                        ),
                    )
                elif not finite(value):  # Celery's encoder writes numpy's float64 NaN as NaN
                    ok, value = (
                        False,
                        ValueError(f"{task} returned {brief(value)}: {_NON_FINITE}; return finite numbers"),
                    )
                elif serializer == "json":
                    ok, value = _tag_refusal(task, value)
            # What JSON carries (orjson writes a UUID or an Enum as its value; Celery's JSON tags a
            # datetime) msgpack may not: that request fails here, not the batch's store.
            if ok and serializer == "msgpack" and packb_plain(value) is None:
                ok, value = (
                    False,
                    TypeError(
                        f"{task} returned {type(value).__name__} {brief(value)}, which msgpack results "
                        "cannot carry unchanged; return lists, dicts with string keys, strings and "
                        "numbers, or store results as JSON (CARPOOL_RESULT_SERIALIZER=json), where "
                        "Celery tags datetimes, UUIDs and decimals"
                    ),
                )
        out.append((ok, value))
    return out


def kombu_json(value: Any) -> bool:
    """Whether Celery's own JSON encoder (which tags datetimes, UUIDs, decimals...) takes ``value``."""
    from kombu.utils.json import dumps

    try:
        dumps(value)  # type: ignore[no-untyped-call]  # kombu is untyped
    except (TypeError, ValueError):
        return False
    return True


def brief(value: Any, limit: int = 80) -> str:
    """A repr of ``value`` for an error message: bounded in size while it is built, and never
    raising (a value whose ``repr`` raises is named by its type)."""
    try:
        text = _BRIEF.repr(value)
    except Exception:
        return f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


_BRIEF = reprlib.Repr()
_BRIEF.maxstring = _BRIEF.maxother = 80
