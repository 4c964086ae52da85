"""``carpool bench`` with another default ``chunk_size`` for ``submit_many`` (an A/B of the default).

    PYTHONPATH=$PWD python scripts/bench_submit_chunk.py none|N BENCH-ARGS...

e.g. ``python scripts/bench_submit_chunk.py none --accelerator h100 --pipeline 0 --light 0``: the
bench's own ``submit_many(texts)`` then sends everything in one MULTI/EXEC, as before streaming
became the default. Only the bench's process (the producer) is affected.
"""

from __future__ import annotations

import sys

import carpool.producer.submit as submit
from carpool.cli import main


def run(argv: list[str]) -> int:
    if not argv:
        raise SystemExit(__doc__)
    chunk, *rest = argv
    defaults = submit.submit_many.__kwdefaults__
    assert defaults is not None
    defaults["chunk_size"] = None if chunk == "none" else int(chunk)
    return main(["bench", *rest])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
