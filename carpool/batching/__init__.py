"""The pure batching core: requests in, batch decisions out, time passed in as a number.

Nothing in this package touches Redis, Celery or torch, so every rule (bins, limits, deadlines,
adaptive wait) is tested with plain numbers under a fake clock. The coordinator feeds it.
"""

from carpool.batching.bins import AutoBins, LengthBins, padded_length
from carpool.batching.latency import LatencyModel
from carpool.batching.policy import BatchPolicy, PolicyConfig
from carpool.batching.types import Batch, FlushReason, Plan, Request

__all__ = [
    "AutoBins",
    "Batch",
    "BatchPolicy",
    "FlushReason",
    "LatencyModel",
    "LengthBins",
    "Plan",
    "PolicyConfig",
    "Request",
    "padded_length",
]
