"""What the simulator replays: arrivals (Poisson, a burst, or a recorded trace file) and their lengths.

Times are simulated seconds and a seed fixes every random draw; only ``workload_lengths`` touches a
model (its tokenizer).
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from carpool.tools.arrivals import poisson_times
from carpool.tools.workload import LengthMix


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request as offered to the coordinator.

    ``deadline_s`` is relative: seconds after ``arrival_s`` the request may take (its ``expires=``);
    None means the default deadline of the run.
    """

    arrival_s: float
    length: int
    priority: int = 0
    deadline_s: float | None = None


class TraceError(ValueError):
    """Raised when a trace file cannot be read as arrivals; the message names the line."""


def burst_arrivals(lengths: Sequence[int], deadline_s: float | None = None) -> list[Arrival]:
    """Every request at time 0, like ``carpool demo``'s burst with an infinitely fast producer."""
    return [Arrival(0.0, n, 0, deadline_s) for n in lengths]


def poisson_arrivals(
    lengths: Sequence[int], rate_per_s: float, seed: int = 0, deadline_s: float | None = None
) -> list[Arrival]:
    """One arrival per length at Poisson times of ``rate_per_s``, the first at time 0.

    The same ``seed`` gives the same gaps scaled to any rate (see ``poisson_times``); an infinite
    rate is a burst.
    """
    times = poisson_times(len(lengths), rate_per_s, seed, first_at_zero=True)
    return [Arrival(t, n, 0, deadline_s) for t, n in zip(times, lengths, strict=True)]


def offered_rate(arrivals: Sequence[Arrival]) -> float:
    """Requests per second the arrivals offer: (n - 1) gaps over their span; inf for a burst."""
    if len(arrivals) < 2:
        return math.inf
    times = [a.arrival_s for a in arrivals]
    span = max(times) - min(times)
    return (len(arrivals) - 1) / span if span > 0 else math.inf


def scale_to_rate(arrivals: Sequence[Arrival], rate_per_s: float) -> list[Arrival]:
    """The same arrivals with time stretched so that they offer ``rate_per_s`` (deadlines kept)."""
    current = offered_rate(arrivals)
    if math.isinf(current) or math.isinf(rate_per_s):
        raise ValueError("a burst (all arrivals at one instant) has no rate to scale")
    factor = current / rate_per_s
    start = min(a.arrival_s for a in arrivals)
    return [replace(a, arrival_s=(a.arrival_s - start) * factor) for a in arrivals]


def uniform_lengths(n: int, low: int, high: int, seed: int = 0) -> list[int]:
    """``n`` token lengths drawn uniformly from ``low..high`` (inclusive), seeded."""
    if not 1 <= low <= high:
        raise ValueError("uniform lengths need 1 <= LO <= HI")
    rng = random.Random(f"lengths:{seed}")
    return [rng.randint(low, high) for _ in range(n)]


def workload_lengths(n: int, seed: int = 0, model: str = "minilm", mix: LengthMix | None = None) -> list[int]:
    """Token lengths of ``carpool.tools.workload.mixed_texts(n, seed, mix)`` under ``model``'s own
    tokenizer (``mix`` None: the default ``LENGTH_MIX``).

    The coordinator bins by exactly these lengths (encode truncates to the model's window), so the
    simulated padding is the padding the real coordinator would produce for the same texts.
    """
    from carpool.models import get_model
    from carpool.tools.workload import LENGTH_MIX, mixed_texts

    return [len(ids) for ids in get_model(model).encode(mixed_texts(n, seed, mix or LENGTH_MIX))]


_TRACE_FIELDS = ("arrival_s", "length", "priority", "deadline_s")


def load_trace(path: str | Path) -> list[Arrival]:
    """Arrivals from JSON lines (objects with ``arrival_s``, ``length``, optional ``priority`` and
    ``deadline_s``) or CSV (``arrival_s,length[,priority,deadline_s]``, header optional).

    Blank lines and lines starting with ``#`` are skipped; the result is sorted by arrival (stable).
    """
    text = Path(path).read_text(encoding="utf-8")
    lines = [(i, line.strip()) for i, line in enumerate(text.splitlines(), 1)]
    lines = [(i, line) for i, line in lines if line and not line.startswith("#")]
    if not lines:
        raise TraceError(f"{path}: no arrivals")
    rows = _json_rows(path, lines) if lines[0][1].startswith("{") else _csv_rows(path, lines)
    arrivals = [_arrival(path, lineno, row) for lineno, row in rows]
    if not arrivals:
        raise TraceError(f"{path}: no arrivals")
    return sorted(arrivals, key=lambda a: a.arrival_s)


def write_trace(path: str | Path, arrivals: Sequence[Arrival]) -> None:
    """Arrivals as JSON lines, the format ``load_trace`` reads (for recording a real run)."""
    with open(path, "w", encoding="utf-8") as out:
        for a in arrivals:
            row: dict[str, float | int] = {"arrival_s": a.arrival_s, "length": a.length}
            if a.priority:
                row["priority"] = a.priority
            if a.deadline_s is not None:
                row["deadline_s"] = a.deadline_s
            out.write(json.dumps(row) + "\n")


def _json_rows(path: str | Path, lines: list[tuple[int, str]]) -> list[tuple[int, dict[str, str]]]:
    rows = []
    for lineno, line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{path}:{lineno}: expected a JSON object")
        rows.append((lineno, {k: "" if v is None else str(v) for k, v in obj.items()}))
    return rows


def _csv_rows(path: str | Path, lines: list[tuple[int, str]]) -> list[tuple[int, dict[str, str]]]:
    parsed = list(csv.reader(io.StringIO("\n".join(line for _, line in lines))))
    names: Sequence[str] = _TRACE_FIELDS
    body = list(zip((i for i, _ in lines), parsed, strict=True))
    first = [c.strip() for c in body[0][1]]
    if first and not _is_number(first[0]):
        names = first
        unknown = set(names) - set(_TRACE_FIELDS)
        if unknown:
            raise TraceError(f"{path}:{body[0][0]}: unknown column(s) {', '.join(sorted(unknown))}")
        body = body[1:]
    rows = []
    for lineno, cells in body:
        if len(cells) > len(names):
            raise TraceError(f"{path}:{lineno}: {len(cells)} columns, expected at most {len(names)}")
        rows.append((lineno, {k: c.strip() for k, c in zip(names, cells, strict=False)}))
    return rows


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _arrival(path: str | Path, lineno: int, row: dict[str, str]) -> Arrival:
    where = f"{path}:{lineno}"
    for required in ("arrival_s", "length"):
        if not row.get(required):
            raise TraceError(f"{where}: missing {required}")
    try:
        arrival_s = float(row["arrival_s"])
        length_f = float(row["length"])
        priority = int(row["priority"]) if row.get("priority") else 0
        deadline = float(row["deadline_s"]) if row.get("deadline_s") else None
    except ValueError as exc:
        raise TraceError(f"{where}: {exc}") from None
    if not math.isfinite(arrival_s) or arrival_s < 0:
        raise TraceError(f"{where}: arrival_s must be a finite number >= 0")
    if not math.isfinite(length_f) or length_f != int(length_f) or length_f < 1:
        raise TraceError(f"{where}: length must be a whole number of tokens >= 1")
    if deadline is not None and not deadline > 0:
        raise TraceError(f"{where}: deadline_s (seconds after arrival) must be > 0")
    return Arrival(arrival_s, int(length_f), priority, deadline)
