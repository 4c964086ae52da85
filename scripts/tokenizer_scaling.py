"""MiniLM's tokenizer on the accelerator workload: CPU per text and throughput with 1..N threads.

Usage: ``PYTHONPATH=$PWD python scripts/tokenizer_scaling.py [--texts 6000] [--threads 1,2] [--chunk 128]``

For each thread count it runs a fresh process (the tokenizers' rayon pool reads its size once, on
first use) and tokenizes the texts of ``carpool bench --accelerator`` (``ACCELERATOR_MIX``) through
``MiniLM.encode`` three ways:

- ``rayon``: one caller, chunks of ``--chunk`` texts, the tokenizers' own pool of that many threads;
- ``callers``: that many Python threads, each encoding its own chunks with the pool off, as the
  coordinator's intake stage runs with ``CARPOOL_TOKENIZER_THREADS`` of that many;
- ``gil_free``: the share of one caller's wall time spent inside ``encode_batch`` with the GIL released.

Prints one JSON line per (mode, threads): wall texts/s, process CPU µs per text, and the speedup over
one thread. CPU time counts every thread of the process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any


def _measure(threads: int, n: int, chunk: int, seed: int) -> list[dict[str, Any]]:
    # The pool's size is read when a batch first runs in parallel; whether one does, at each call.
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    from carpool.models.minilm import MiniLM
    from carpool.tools.workload import ACCELERATOR_MIX, mixed_texts

    texts = mixed_texts(n, seed, ACCELERATOR_MIX)
    chunks = [texts[i : i + chunk] for i in range(0, n, chunk)]
    model = MiniLM()
    model.encode(texts[:64])  # load the tokenizer and start the pool outside the timing
    rows = []

    def timed(mode: str, run: Any) -> None:
        best_wall, best_cpu = float("inf"), float("inf")
        for _ in range(3):
            w0, c0 = time.perf_counter(), time.process_time()
            run()
            best_wall = min(best_wall, time.perf_counter() - w0)
            best_cpu = min(best_cpu, time.process_time() - c0)
        rows.append(
            {
                "mode": mode,
                "threads": threads,
                "chunk": chunk,
                "texts": n,
                "texts_per_s": round(n / best_wall),
                "cpu_us_per_text": round(best_cpu / n * 1e6, 1),
                "wall_us_per_text": round(best_wall / n * 1e6, 1),
            }
        )

    timed("rayon", lambda: [model.encode(c) for c in chunks])

    # Several callers, each on its own chunks, with the pool off.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"

    def callers() -> None:
        def work(k: int) -> None:
            for c in chunks[k::threads]:
                model.encode(c)

        pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()

    timed("callers", callers)

    if threads == 1:  # how much of one caller's time is outside the GIL (inside encode_batch)
        model._get_tokenizer()
        inner = 0.0

        def counting(batch: Any) -> Any:
            def timed(*args: Any, **kwargs: Any) -> Any:
                nonlocal inner
                t0 = time.perf_counter()
                try:
                    return batch(*args, **kwargs)
                finally:
                    inner += time.perf_counter() - t0

            return timed

        full, fast = model._encode_batch, model._ascii
        if fast is not None:  # the ASCII path's bare tokenizer (carpool.models.bert_ascii)
            fast_batch = fast.encode_batch
            fast.encode_batch = counting(fast_batch)
        model._encode_batch = counting(full)
        t0 = time.perf_counter()
        for c in chunks:
            model.encode(c)
        total = time.perf_counter() - t0
        model._encode_batch = full
        if fast is not None:
            fast.encode_batch = fast_batch
        rows.append({"mode": "gil_free", "threads": 1, "share_in_encode_batch": round(inner / total, 3)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--texts", type=int, default=6000)
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--chunk", type=int, default=128, help="texts per encode call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # child: measure this count
    args = parser.parse_args()
    if args.one is not None:
        for row in _measure(args.one, args.texts, args.chunk, args.seed):
            print(json.dumps(row), flush=True)
        return
    base: dict[str, float] = {}
    for threads in (int(t) for t in args.threads.split(",")):
        cmd = [sys.executable, __file__, "--one", str(threads), "--texts", str(args.texts)]
        cmd += ["--chunk", str(args.chunk), "--seed", str(args.seed)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=dict(os.environ)).stdout
        for line in out.splitlines():
            row = json.loads(line)
            if "texts_per_s" in row:
                base.setdefault(row["mode"], row["texts_per_s"])
                row["speedup"] = round(row["texts_per_s"] / base[row["mode"]], 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
