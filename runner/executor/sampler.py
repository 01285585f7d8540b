"""Next-token selection: greedy, or temperature / top-k / top-p with per-request seeds.

A sampled token is drawn by inverse CDF with one uniform number that depends only on
the request's seed and its position, so batch composition never changes a request's
tokens, and a request resumed elsewhere (migration) continues the same stream.

`sample_tokens` works on the per-row parameters packed by `pack_sampling` (the step batch
carries them and copies them to the device with its other numbers) and returns the token ids as
a device tensor without synchronising, so the host can build the next step while the device still
runs this one. `token_logprobs` gives the sampled tokens' log-probabilities (and the most likely
alternatives) under the model's own distribution, for the requests that ask for them.
"""

from __future__ import annotations

import random

import torch


MAX_LOGPROBS = 20  # alternatives per token a request may ask for with its log-probability (OpenAI's bound)
MIN_LOGPROB = -9999.0  # a log-probability of -inf (a token the model rules out) as JSON can carry it


def uniform_for(seed: int, position: int) -> float:
    return random.Random(f"{seed}:{position}").random()


def pack_sampling(temperature: list[float], top_p: list[float], top_k: list[int],
                  uniform: list[float]) -> torch.Tensor | None:
    """The per-row sampling parameters as one float32 CPU tensor [4, S] (temperature, top_p, top_k, the
    draw u), for one copy to the device; None when every row is greedy (no parameter is read then)."""
    if all(t == 0.0 or k == 1 for t, k in zip(temperature, top_k)):
        return None
    return torch.tensor([temperature, top_p, [float(k) for k in top_k], uniform], dtype=torch.float32)


def sample_tokens(logits: torch.Tensor, params: torch.Tensor | None) -> torch.Tensor:
    """logits fp32 [S, V]; `params` float32 [4, S] on the logits' device (pack_sampling: per row the
    temperature (0: greedy), top_p, top_k (0: off) and the draw u in [0, 1)), or None when every row is
    greedy -> int64 [S] token ids on the logits' device. No host synchronisation: nothing is read back
    and nothing is copied from the host here."""
    out = logits.argmax(-1)
    if params is None:
        return out
    temp, tp, tk, u = params.unbind(0)
    greedy = (temp == 0) | (tk == 1)
    V = logits.shape[1]
    probs = (logits / torch.where(greedy, 1.0, temp)[:, None]).softmax(-1)  # [S, V]
    sorted_p, order = probs.sort(-1, descending=True)
    rank = torch.arange(V, device=logits.device)[None, :]
    tk = torch.where(tk > 0, tk, float(V))
    before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly more likely tokens
    keep = (rank < tk[:, None]) & ((before < tp[:, None]) | (rank == 0))
    sorted_p = sorted_p * keep
    cdf = sorted_p.cumsum(-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_max(V - 1)
    # never land on a filtered-out token (zero-width CDF step)
    pick = torch.minimum(pick, keep.sum(-1, keepdim=True) - 1)
    return torch.where(greedy, out, order.gather(1, pick).squeeze(1))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits fp32 [S, V], the sampled ids int64 [S], `k` >= 0 alternatives -> (the ids' log-probabilities fp32 [S],
    the k most likely ids int64 [S, k] and their log-probabilities fp32 [S, k], most likely first), all under
    log_softmax(logits): the model's distribution, before temperature, top-k and top-p; -inf as MIN_LOGPROB. No host
    synchronisation."""
    logp = logits.float().log_softmax(-1)  # [S, V]
    chosen = logp.gather(1, tokens[:, None]).squeeze(1).clamp_min(MIN_LOGPROB)
    top = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], tokens.new_empty((logp.shape[0], 0)))
    return chosen, top[1], top[0].clamp_min(MIN_LOGPROB)
