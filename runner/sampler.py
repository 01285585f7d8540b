"""Next-token selection: greedy, or temperature / top-k / top-p with per-request seeds.

A sampled token is drawn by inverse CDF with one uniform number that depends only on
the request's seed and its position, so batch composition never changes a request's
tokens, and a request resumed elsewhere (migration) continues the same stream.

`sample_tokens` works on plain per-row arrays (the step batch carries them) and returns the
token ids as a device tensor without synchronising, so the host can build the next step while
the device still runs this one. `sample` is the same over a list of requests, returning ids.
"""

from __future__ import annotations

import random

import torch

from lorafleet.runner.sequence import Sequence


def uniform_for(seed: int, position: int) -> float:
    return random.Random(f"{seed}:{position}").random()


def sample_tokens(logits: torch.Tensor, temperature: list[float], top_p: list[float], top_k: list[int],
                  uniform: list[float]) -> torch.Tensor:
    """logits fp32 [S, V]; per row: temperature (0: greedy), top_p, top_k (0: off) and the draw
    u in [0, 1) -> int64 [S] token ids on the logits' device. No host synchronisation."""
    out = logits.argmax(-1)
    rows = [i for i, (t, k) in enumerate(zip(temperature, top_k)) if not (t == 0.0 or k == 1)]
    if not rows:
        return out
    dev = logits.device
    idx = torch.tensor(rows, device=dev)
    temp = torch.tensor([temperature[i] for i in rows], device=dev)
    probs = (logits.index_select(0, idx) / temp[:, None]).softmax(-1)  # [R, V]
    sorted_p, order = probs.sort(-1, descending=True)
    rank = torch.arange(probs.shape[1], device=dev)[None, :]
    tk = torch.tensor([top_k[i] or probs.shape[1] for i in rows], device=dev)
    tp = torch.tensor([top_p[i] for i in rows], device=dev)
    before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly more likely tokens
    keep = (rank < tk[:, None]) & ((before < tp[:, None]) | (rank == 0))
    sorted_p = sorted_p * keep
    cdf = sorted_p.cumsum(-1)
    u = torch.tensor([uniform[i] for i in rows], device=dev, dtype=cdf.dtype)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_max(probs.shape[1] - 1)
    # never land on a filtered-out token (zero-width CDF step)
    pick = torch.minimum(pick, keep.sum(-1, keepdim=True) - 1)
    return out.index_put((idx,), order.gather(1, pick).squeeze(1))


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits fp32 [B, V] (row i belongs to seqs[i], each sampling its position num_tokens) -> ids."""
    ps = [s.params for s in seqs]
    u = [0.0 if p.greedy else uniform_for(s.sample_seed, s.num_tokens) for s, p in zip(seqs, ps)]
    return sample_tokens(logits, [p.temperature for p in ps], [p.top_p for p in ps], [p.top_k for p in ps], u).tolist()
