"""Seeded mixed-length English-like texts, the workload of ``carpool demo`` and ``carpool bench``.

Length distribution (words): 60% short (3-20), 30% medium (21-80), 10% long (81-300, past the
minilm window of 256 tokens for the longest ones). Real traffic is rarely uniform; this mix is
where padding hurts FIFO batching most.

``ACCELERATOR_MIX`` (``carpool bench --accelerator``) adds a tail of documents: about 3% of texts
run past the window by up to several thousand characters, so a tokenizer that reads them in full
pays for it while the model sees no more tokens.

``rerank_pairs`` (``carpool bench --task reranker``) pairs a short query with each of those texts as
its passage: the pairs' lengths follow the passages' mix.
"""

from __future__ import annotations

import random

# A word list reads better as prose than as 300 quoted strings.
WORDS = (  # noqa: SIM905
    "the of and to in is was for that on with as by at from his her they this which be or are an "
    "had not but have one all were when there can more their if would about out up what so into time "
    "only some could them other new people than first water been called who oil its now find long "
    "down day did get come made may part over sound take year live back give most very after thing "
    "our just name good sentence man think say great where help through much before line right too "
    "mean old any same tell boy follow came want show also around form three small set put end does "
    "another well large must big even such because turn here why ask went men read need land "
    "different home us move try kind hand picture again change off play spell air away animal house "
    "point page letter mother answer found study still learn should america world high every near "
    "add food between own below country plant last school father keep tree never start city earth "
    "eye light thought head under story saw left few while along might close something seem next "
    "hard open example begin life always those both paper together got group often run important "
    "until children side feet car mile night walk white sea began grow took river four carry state "
    "once book hear stop without second later miss idea enough eat face watch far indian really "
    "almost let above girl sometimes mountain cut young talk soon list song being leave family"
).split()

# (share of texts, fewest words, most words) per class; shares add up to 1.
LengthMix = tuple[tuple[float, int, int], ...]

LENGTH_MIX: LengthMix = ((0.6, 3, 20), (0.3, 21, 80), (0.1, 81, 300))
ACCELERATOR_MIX: LengthMix = ((0.6, 3, 22), (0.3, 21, 85), (0.07, 86, 220), (0.03, 300, 1800))


def mixed_texts(n: int, seed: int = 0, mix: LengthMix = LENGTH_MIX) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        pick = rng.random()
        low, high = mix[-1][1:]
        for share, lo, hi in mix:
            if pick < share:
                low, high = lo, hi
                break
            pick -= share
        count = rng.randint(low, high)
        words = [rng.choice(WORDS) for _ in range(count)]
        words[0] = words[0].capitalize()
        texts.append(" ".join(words) + ".")
    return texts


def describe(mix: LengthMix = LENGTH_MIX) -> str:
    return ", ".join(f"{round(s * 100)}% {lo}-{hi} words" for s, lo, hi in mix)


def rerank_pairs(n: int, seed: int = 0) -> list[list[str]]:
    """``n`` [query, passage] pairs: a 2-8 word query and a passage from :func:`mixed_texts`."""
    # Seeded apart from the passages, so a query does not echo its passage's first words.
    rng = random.Random(f"queries-{seed}")
    pairs = []
    for passage in mixed_texts(n, seed):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 8))]
        pairs.append([" ".join(words).capitalize() + "?", passage])
    return pairs
