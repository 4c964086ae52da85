"""Pieces shared by the unit tests' stand-ins for :class:`carpool.redis_edge.store.RequestStore`."""

from __future__ import annotations

from typing import Any


class AnswersByFinish:
    """``answer`` as :meth:`RequestStore.answer` makes it with the results on the broker's server:
    one ``finish`` call, which the stand-in records."""

    def finish(self, **kwargs: Any) -> list[int]:
        raise NotImplementedError

    def answer(self, backend: Any, dbs: Any, writes: Any, ack_ids: Any, **kwargs: Any) -> list[int]:
        return self.finish(writes=writes, ack_ids=ack_ids, **kwargs)
