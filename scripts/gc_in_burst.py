"""The garbage collections each process ran during an accelerator bench run's burst.

    mkdir -p /tmp/gc && rm -f /tmp/gc/gc-*.json
    CARPOOL_GC_PROBE_DIR=/tmp/gc PYTHONPATH=scripts/gc_probe:$PWD \\
        carpool bench --accelerator v100 --pipeline 0 --light 0 --requests 20000 --out OUT
    python scripts/gc_in_burst.py OUT /tmp/gc

Per process (the bench's own, which is the producer, its coordinator and its worker): the
collections that began between the submit call and ``gather``'s return, per generation (count and
milliseconds), the longest one, and how many objects they freed. ``scripts/gc_probe`` records them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _role(argv: list[str]) -> str:
    for role in ("coordinator", "worker", "bench"):
        if role in argv:
            return "producer (bench)" if role == "bench" else role
    return " ".join(argv[:2])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="the bench's --out folder")
    parser.add_argument("probe_dir", type=Path, help="CARPOOL_GC_PROBE_DIR of that run")
    args = parser.parse_args()
    run = json.loads((args.out / "report.json").read_text())["carpool"]
    start, end = run["wall_start"], run["wall_start"] + run["wall_s"]
    print(f"{args.out}: ratio {run['ratio_to_capacity']:.3f}, burst {run['wall_s'] * 1e3:.0f} ms")
    for path in sorted(args.probe_dir.glob("gc-*.json")):
        probe = json.loads(path.read_text())
        burst = [c for c in probe["collections"] if start <= c[0] <= end]
        per_gen: dict[int, list[float]] = {}
        for _, generation, seconds, _ in burst:
            per_gen.setdefault(generation, []).append(seconds)
        gens = ", ".join(f"gen{g}: {len(s)} in {sum(s) * 1e3:.1f} ms" for g, s in sorted(per_gen.items()))
        longest = max((c[2] for c in burst), default=0.0) * 1e3
        freed = sum(c[3] for c in burst)
        print(f"  {_role(probe['argv'])}: {gens or 'none'}; longest {longest:.1f} ms; freed {freed} objects")


if __name__ == "__main__":
    main()
