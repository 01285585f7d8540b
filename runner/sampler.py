"""Next-token selection: greedy, or temperature / top-k / top-p with per-request seeds.

A sampled token is drawn by inverse CDF with one uniform number that depends only on
the request's seed and its position, so batch composition never changes a request's
tokens, and a request resumed elsewhere (migration) continues the same stream.
"""

from __future__ import annotations

import random

import torch

from lorafleet.runner.sequence import Sequence


def uniform_for(seed: int, position: int) -> float:
    return random.Random(f"{seed}:{position}").random()


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits fp32 [B, V] (row i belongs to seqs[i]) -> one token id per row."""
    out = logits.argmax(-1)
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        temp = torch.tensor([seqs[i].params.temperature for i in rows], device=logits.device)
        probs = (logits.index_select(0, idx) / temp[:, None]).softmax(-1)  # [S, V]
        sorted_p, order = probs.sort(-1, descending=True)
        rank = torch.arange(probs.shape[1], device=logits.device)[None, :]
        top_k = torch.tensor([seqs[i].params.top_k or probs.shape[1] for i in rows], device=logits.device)
        top_p = torch.tensor([seqs[i].params.top_p for i in rows], device=logits.device)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly more likely tokens
        keep = (rank < top_k[:, None]) & ((before < top_p[:, None]) | (rank == 0))
        sorted_p = sorted_p * keep
        cdf = sorted_p.cumsum(-1)
        u = torch.tensor(
            [uniform_for(seqs[i].sample_seed, seqs[i].num_tokens) for i in rows], device=logits.device, dtype=cdf.dtype
        )
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_max(probs.shape[1] - 1)
        # never land on a filtered-out token (zero-width CDF step)
        pick = torch.minimum(pick, keep.sum(-1, keepdim=True) - 1)
        out = out.index_put((idx,), order.gather(1, pick).squeeze(1))
    return out.tolist()
