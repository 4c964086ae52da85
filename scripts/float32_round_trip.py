"""Every finite float32, written as carpool writes a model's float32 row, read back as a JSON reader does.

    python scripts/float32_round_trip.py [--chunk-bits 22]

orjson writes each value in its shortest float32 form (what :func:`carpool.codec.dumps_result` does
with a float32 array); the text is parsed into float64s (orjson, as carpool's producer does) and cast
to float32. Prints every value that comes back as another float32, and how many there were: the
values :func:`carpool.codec.float32_rows` exists to catch (docs/PERFORMANCE.md, "Compact results").
Takes about 20 minutes of one core and ~0.5 GB of memory at the default chunk size.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import orjson


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunk-bits", type=int, default=22, help="2**N values per step")
    opts = parser.parse_args()
    chunk = 1 << opts.chunk_bits
    wrong: list[float] = []
    checked = 0
    started = time.monotonic()
    for first in range(0, 1 << 32, chunk):
        values = np.arange(first, first + chunk, dtype=np.uint64).astype(np.uint32).view(np.float32)
        values = values[np.isfinite(values)]
        text = orjson.dumps(values, option=orjson.OPT_SERIALIZE_NUMPY)
        read = np.array(orjson.loads(text), dtype=np.float64).astype(np.float32)
        off = (read.view(np.uint32) != values.view(np.uint32)) & (values != 0)  # -0.0 may read as 0.0
        for value in values[off].tolist():
            print(f"comes back as another float32: {value!r} (bits {np.float32(value).view(np.uint32)})")
        wrong += values[off].tolist()
        checked += values.size
    print(
        f"{checked} finite float32 values, {len(wrong)} read back as another float32 "
        f"({time.monotonic() - started:.0f}s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
