"""Batched tasks by name: what the coordinator needs to bin a request, and what a worker runs.

``@carpool.batched`` fills the registry when a task module is imported: producers import it to call
``.delay()``, the coordinator and workers import the modules named in ``CARPOOL_IMPORTS``. Nothing
here loads a model; a spec's ``load`` runs on a worker, once per process.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from carpool.errors import ConfigError

log = logging.getLogger(__name__)

BatchFunction = Callable[[list[Any]], Sequence[Any]]
LengthFunction = Callable[[Any], int]


@dataclass(frozen=True, slots=True)
class BatchedSpec:
    """One batched task: its batch function, its length function and its own batching limits.

    ``None`` limits fall back to the deployment's settings (``CARPOOL_MAX_BATCH``, ...).
    """

    name: str
    fn: BatchFunction
    length: LengthFunction
    max_batch: int | None = None
    max_tokens: int | None = None
    bin_edges: tuple[int, ...] | Literal["auto"] | None = None
    batch_queue: str | None = None  # None: the deployment's batch queue

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"batched task {self.name!r}: the batch function must be callable")
        if not callable(self.length):
            raise TypeError(
                f"batched task {self.name!r}: length= must be a function item -> int "
                "(e.g. length=len for texts)"
            )
        for field, value in (("max_batch", self.max_batch), ("max_tokens", self.max_tokens)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(
                    f"batched task {self.name!r}: {field} must be an integer >= 1, not {value!r}"
                )
        edges = self.bin_edges
        if edges is not None and edges != "auto" and not _increasing_positive(edges):
            raise ValueError(
                f"batched task {self.name!r}: bins must be 'auto' or increasing positive integers, "
                f"not {edges!r}"
            )

    def lengths(self, items: Sequence[Any]) -> list[int]:
        """``length`` of each item; uses the function's batch form (``.lengths``) when it has one."""
        batch_form = getattr(self.length, "__self__", None)
        many = getattr(batch_form, "lengths", None)
        if callable(many):
            return list(many(items))
        return [self.length(item) for item in items]

    def load(self, device: str) -> None:
        """Build the function's heavy state on ``device`` when it has a ``load`` (adapters do)."""
        load = getattr(self.fn, "load", None)
        if callable(load):
            load(device)


def _increasing_positive(edges: tuple[int, ...]) -> bool:
    ok = all(isinstance(e, int) and not isinstance(e, bool) and e >= 1 for e in edges)
    return ok and bool(edges) and list(edges) == sorted(set(edges))


_SPECS: dict[str, BatchedSpec] = {}


def register(spec: BatchedSpec) -> None:
    """Make ``spec`` known by its name; a second, different task under one name is a mistake."""
    known = _SPECS.get(spec.name)
    if known is not None and known.fn is not spec.fn:
        raise ConfigError(
            f"two batched tasks are named {spec.name!r}; give one of them another name= in @batched"
        )
    _SPECS[spec.name] = spec


def spec_for(name: str) -> BatchedSpec | None:
    return _SPECS.get(name)


def registered() -> dict[str, BatchedSpec]:
    """Every batched task imported in this process, by name."""
    return dict(_SPECS)


def import_task_modules(modules: Iterable[str]) -> list[str]:
    """Import each module (``CARPOOL_IMPORTS``) so its ``@batched`` tasks register; returns their names."""
    before = set(_SPECS)
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(
                f"CARPOOL_IMPORTS names {module!r}, which cannot be imported ({exc}); "
                "make it importable on this host (installed, or on PYTHONPATH)"
            ) from exc
    added = sorted(set(_SPECS) - before)
    if added:
        log.info("batched tasks imported: %s", ", ".join(added))
    return added
