"""Every name two carpool processes must agree on, defined once.

Producers, the coordinator, workers, the tools and the tests import these instead of spelling the
strings; a rename happens here or nowhere.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

# Celery task names.
INFER_TASK: Final = "carpool.infer"
RUN_BATCH_TASK: Final = "carpool.run_batch"
# Why a carpool.run_batch sent by anyone but a coordinator (a link, a chain step, send_task) is refused.
NOT_SENDABLE: Final = (
    f"{RUN_BATCH_TASK} is carpool's own batch task, which only coordinators send, with the batch they"
    " made; it cannot be sent as a task, a link or a chain step: send requests to carpool.infer or a"
    " @batched task"
)

# Message header a producer stamps (wall clock, s) so waiting is measured from the real arrival.
SENT_AT_HEADER: Final = "carpool_sent_at"
# Message header naming the producer process's result inbox: the pub/sub channel where each of that
# process's results is published as well as on its own channel.
INBOX_HEADER: Final = "carpool_inbox"
# An inbox channel's name: the result key prefix, this, then a random id per producer process.
INBOX_CHANNEL: Final = "carpool.inbox."

# Default queue names (settings may override them).
DEFAULT_REQUEST_QUEUE: Final = "carpool.requests"
DEFAULT_BATCH_QUEUE: Final = "carpool.batches"


def coordinator_hostname(pid: int, host: str) -> str:
    """A coordinator's name in events, stats and batch reports (process ``pid`` on ``host``)."""
    return f"carpool-coordinator-{pid}@{host}"


# Batching policies the coordinator and the simulator know.
PolicyName = Literal["binned", "fifo", "shortest"]
POLICY_NAMES: Final[tuple[PolicyName, ...]] = get_args(PolicyName)

# Token-length bin edges used when a deployment names none: a bin per range, the last one open.
DEFAULT_BIN_EDGES: Final[tuple[int, ...]] = (16, 32, 48, 64, 96, 128, 192)
#: The most requests one batch may hold (``CARPOOL_MAX_BATCH``, a @batched task's ``max_batch=``).
MAX_BATCH_LIMIT: Final = 4096
