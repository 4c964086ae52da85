"""Models by name: ``minilm``, ``toy``, ``null``, ``sim-v100`` / ``sim-h100`` / ``sim``, or
``package.module:ClassName`` (see ``base``).

Only names and classes live here; weights load in ``BatchModel.load`` on the worker. ``task`` makes
the served models the task ``carpool.infer``.
"""

from __future__ import annotations

import importlib

from carpool.errors import ConfigError, UnknownModel
from carpool.models.base import BatchModel

BUILTIN = {
    "minilm": "carpool.models.minilm:MiniLM",
    "toy": "carpool.models.toy:ToyModel",
    "null": "carpool.models.null:NullModel",
    "sim": "carpool.models.simdevice:SimulatedDevice",
    "sim-v100": "carpool.models.simdevice:V100",
    "sim-h100": "carpool.models.simdevice:H100",
}

_instances: dict[str, BatchModel] = {}


def is_valid_name(name: str) -> bool:
    """Whether ``name`` could name a model: a built-in or a ``module:Class`` path."""
    if name in BUILTIN:
        return True
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr)


def get_model(name: str) -> BatchModel:
    """The (unloaded) model called ``name``, one instance per process."""
    model = _instances.get(name)
    if model is None:
        model = _instances[name] = _build(name)
    return model


def _build(name: str) -> BatchModel:
    target = BUILTIN.get(name, name)
    module_name, sep, attr = target.partition(":")
    if not sep:
        raise UnknownModel(
            f"unknown model {name!r}: use one of {', '.join(BUILTIN)} "
            "or an import path package.module:ClassName"
        )
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UnknownModel(f"model {name!r} cannot be imported: {exc}") from None
    try:
        model = cls()
    except Exception as exc:  # a traceback at start, in every process, before
        raise ConfigError(
            f"model {name!r} could not be built: {attr}() raised {type(exc).__name__}: {exc} (carpool builds"
            " a model with no arguments; read its settings in __init__ or in load())"
        ) from None
    # Every member of BatchModel: one missing failed each request as if its input were wrong.
    members = ("encode", "load", "forward", "max_length", "pad_id", "needs_token_ids")
    missing = [m for m in members if not hasattr(model, m)]
    if missing:
        raise ConfigError(f"model {name!r} lacks {', '.join(missing)}: see carpool.models.base.BatchModel")
    return model  # type: ignore[no-any-return]


__all__ = ["BUILTIN", "BatchModel", "get_model", "is_valid_name"]
