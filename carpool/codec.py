"""JSON on the hot paths: orjson where its output means the same as the standard library's.

Every request is decoded by the coordinator and every result, task event and batch report is
encoded once per request; with ``json`` those calls are the largest single cost per request after
the Redis round trips, and orjson does both several times faster. Two things differ, and both are
kept out:

- orjson rejects what ``json.loads`` accepts beyond strict JSON (lone surrogate escapes, ``NaN``,
  integers past 64 bits). :func:`loads` then falls back to ``json.loads``, so a message that
  decoded before still decodes the same, and validation names what is wrong with its text.
- orjson encodes natively some types that kombu's JSON encoder tags (``datetime``, dataclasses,
  subclasses of builtins, numpy values). :func:`dumps_plain` refuses those (returns None) and the
  caller takes its usual path; it is meant for values made of dicts, lists, strings and numbers
  (model outputs, result metas). ``uuid.UUID`` is the exception orjson cannot be told to refuse: it
  becomes its string, so callers holding arbitrary user values check them first
  (:func:`flat_plain`); an ``Enum`` member becomes its value. A non-finite float, which the
  standard library writes as the non-JSON ``NaN``, becomes ``null`` (as in JavaScript's
  ``JSON.stringify``).
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

_PLAIN = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_SUBCLASS


def loads(data: bytes | str) -> Any:
    """``json.loads(data)``, faster for strict JSON (what every Celery producer writes)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def dumps_plain(value: Any) -> bytes | None:
    """Compact UTF-8 JSON of ``value`` if it is made of plain JSON types only, else None."""
    try:
        return orjson.dumps(value, option=_PLAIN)
    except TypeError:  # orjson.JSONEncodeError: a type kombu's encoder would tag, or a non-str key
        return None


def flat_plain(args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any]) -> bool:
    """True when every argument is a str, int, float, bool or None (exact types): task arguments that
    :func:`dumps_plain` writes exactly as kombu would."""
    return all(type(v) in _SCALARS for v in args) and all(type(v) in _SCALARS for v in kwargs.values())


_SCALARS = frozenset({str, int, float, bool, type(None)})


def dumps_lenient(value: Any) -> bytes:
    """Compact UTF-8 JSON; what JSON cannot express is written as its ``str`` (telemetry: events)."""
    return orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS)


def dumps_exact(value: Any) -> bytes:
    """JSON of ``value`` that decodes back to an equal value, or raise ``TypeError``/``ValueError``
    saying why not: a type JSON lacks, a non-str key, an integer past 64 bits, a lone surrogate
    (``TypeError``), or a non-finite float (``ValueError``)."""
    encoded: bytes = orjson.dumps(value, option=_PLAIN)
    if not finite(value):
        raise ValueError("a non-finite float (inf or nan), which JSON cannot write")
    return encoded


def finite(value: Any) -> bool:
    """No inf or nan anywhere in ``value``."""
    if type(value) is float:
        return math.isfinite(value)
    if isinstance(value, list | tuple):
        if all(type(v) is float for v in value):  # a vector: checked in one C-level pass
            return all(map(math.isfinite, value))
        return all(map(finite, value))
    if isinstance(value, dict):
        return all(map(finite, value.values()))
    return True
