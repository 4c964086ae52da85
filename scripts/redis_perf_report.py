"""Summarise ``perf script`` output of a redis-server (scripts/redis_perf.sh): each function's share
of the samples anywhere in the stack, and the commands run from Lua (the frame under the innermost
``call`` of a stack that has two).

    python scripts/redis_perf_report.py /tmp/redis-perf/perf.stacks
"""

from __future__ import annotations

import re
import sys
from collections import Counter

FRAME = re.compile(r"\s+[0-9a-f]+ (\S+?)(\+0x[0-9a-f]+)? \(")
# Where the time goes, coarsely: each is inclusive (a sample counts for every one on its stack).
SHOWN = [
    "evalGenericCommand",
    "luaRedisGenericCommand",
    "luaSetGlobalArray",
    "luaReplyToRedisReply",
    "luaC_step",
    "str_find_aux",
    "processMultibulkBuffer",
    "writeToClient",
    "__vfprintf_internal",
    "addReplyDouble",
    "ziplistFind",
    "lpFind",
    "dictFind",
]


def stacks(path: str) -> list[list[str]]:
    found: list[list[str]] = []
    current: list[str] = []
    with open(path, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if not line.strip():
                if current:
                    found.append(current)
                current = []
                continue
            m = FRAME.match(line)
            if m:
                current.append(m.group(1))
    if current:
        found.append(current)
    return found


def main() -> int:
    samples = stacks(sys.argv[1])
    n = len(samples)
    if not n:
        print("no samples")
        return 1
    print(f"{n} samples; share of redis-server's samples with the function anywhere on the stack:")
    for name in SHOWN:
        share = sum(name in s for s in samples) / n
        if share:
            print(f"  {name:28s} {100 * share:5.1f}%")
    from_lua: Counter[str] = Counter()
    for s in samples:
        calls = [i for i, f in enumerate(s) if f == "call"]
        if len(calls) > 1 and calls[0] > 0:
            from_lua[s[calls[0] - 1]] += 1
    print("commands run from Lua scripts (share of all samples):")
    for name, count in from_lua.most_common(14):
        print(f"  {name:28s} {100 * count / n:5.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
