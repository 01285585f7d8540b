"""The four adapter-popularity workloads of the Punica paper (row -> adapter), and ShareGPT-like lengths."""

from __future__ import annotations

import math

import numpy as np

WORKLOADS = ("distinct", "uniform", "skewed", "identical")


def assign(workload: str, n: int, num_adapters: int, seed: int = 0) -> list[int]:
    """Adapter index (0..num_adapters-1) for each of n requests.

    distinct: every request its own adapter; uniform: ceil(sqrt(n)) adapters, equally likely;
    skewed: Zipf alpha=1.5 popularity; identical: one adapter for all.
    """
    rng = np.random.default_rng(seed)
    if workload == "distinct":
        if n > num_adapters:
            raise ValueError("distinct needs at least n adapters")
        return rng.permutation(num_adapters)[:n].tolist()
    if workload == "uniform":
        k = min(num_adapters, math.ceil(math.sqrt(n)))
        return rng.integers(0, k, size=n).tolist()
    if workload == "skewed":
        ranks = np.arange(1, num_adapters + 1, dtype=np.float64)
        p = ranks ** -1.5
        p /= p.sum()
        return rng.choice(num_adapters, size=n, p=p).tolist()
    if workload == "identical":
        return [0] * n
    raise ValueError(workload)


def sharegpt_requests(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs; lognormal fits of filtered ShareGPT lengths (means about
    250 prompt and 235 output tokens). Ids are drawn from [3, vocab)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p = int(np.clip(rng.lognormal(5.2, 0.85), 8, 1536))
        o = int(np.clip(rng.lognormal(5.22, 0.75), 8, 1024))
        out.append((rng.integers(3, vocab, size=p).tolist(), o))
    return out
