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

import dataclasses
import random
from dataclasses import dataclass, field

import torch


MIN_LOGPROB = -9999.0  # a log-probability of -inf (a token the model rules out) as JSON can carry it


def uniform_for(seed: int, position: int) -> float:
    return random.Random(f"{seed}:{position}").random()


def pack_sampling(temperature: list[float], top_p: list[float], top_k: list[int],
                  uniform: list[float], min_p: list[float] | None = None) -> torch.Tensor | None:
    """The per-row sampling parameters as one float32 CPU tensor [5, S] (temperature, top_p, top_k, the
    draw u, min_p (default 0)), for one copy to the device; None when every row is greedy (no parameter is read
    then)."""
    if all(t == 0.0 or k == 1 for t, k in zip(temperature, top_k)):
        return None
    return torch.tensor([temperature, top_p, [float(k) for k in top_k], uniform,
                         min_p if min_p is not None else [0.0] * len(uniform)], dtype=torch.float32)


def sample_tokens(logits: torch.Tensor, params: torch.Tensor | None) -> torch.Tensor:
    """logits fp32 [S, V]; `params` float32 [5, S] on the logits' device (pack_sampling: per row the
    temperature (0: greedy), top_p, top_k (0: off), the draw u in [0, 1) and min_p (0: off: a token less likely
    than min_p times the most likely one is not drawn)), or None when every row is greedy -> int64 [S] token ids on
    the logits' device. No host synchronisation: nothing is read back and nothing is copied from the host here."""
    out = logits.argmax(-1)
    if params is None:
        return out
    temp, tp, tk, u, mp = params.unbind(0)
    greedy = (temp == 0) | (tk == 1)
    V = logits.shape[1]
    # each row's largest logit subtracted before the temperature divides: a tiny temperature (or a logit at the
    # float32 limit after a penalty) then gives -inf steps below the top, never inf - inf, so the draw stays greedy
    # in the limit instead of landing on an arbitrary token
    top = logits.amax(-1, keepdim=True)
    probs = ((logits - top) / torch.where(greedy, 1.0, temp)[:, None]).softmax(-1)  # [S, V]
    sorted_p, order = probs.sort(-1, descending=True)
    rank = torch.arange(V, device=logits.device)[None, :]
    tk = torch.where(tk > 0, tk, float(V))
    before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly more likely tokens
    # the most likely token always stays (also where the probabilities are not numbers: never an empty row)
    keep = ((rank < tk[:, None]) & (before < tp[:, None]) & (sorted_p >= mp[:, None] * sorted_p[:, :1])) | (rank == 0)
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


@dataclass
class PromptRows:
    """The prompt positions of one step whose next token's log-probability a request asked for
    (SamplingParams.prompt_logprobs): per entry the step's input row, the prompt token that follows it, the
    alternatives asked for, and the request's index in the step batch."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    k: list[int] = field(default_factory=list)
    owner: list[int] = field(default_factory=list)

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, w: dict) -> "PromptRows":
        return cls(**w)


@dataclass
class LogitAdjust:
    """The changes of one step's logits before sampling (SamplingParams' penalties, logit_bias, min_tokens), as
    sparse host lists over the sampled rows j in [0, S), built by the step batch for steps where a row asks.

    counts: (j, id, n) output tokens read back so far; pending: (j, r) a row whose request's newest output token is
    still on the device, as the step's input row r (its count is added there); seen: (j, ids) the distinct prompt
    ids of row j (repetition penalty; `ids` an int64 CPU tensor the request keeps); bias: (j, id, b); ban: (j, id)
    ids that cannot be sampled (min_tokens). presence / frequency / repetition: [S] per row (0, 0, 1: none)."""

    presence: list[float]
    frequency: list[float]
    repetition: list[float]
    counts: list[tuple[int, int, float]] = field(default_factory=list)
    pending: list[tuple[int, int]] = field(default_factory=list)
    seen: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    bias: list[tuple[int, int, float]] = field(default_factory=list)
    ban: list[tuple[int, int]] = field(default_factory=list)

    def to_wire(self) -> dict:
        w = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        w["seen"] = [(j, ids.tolist()) for j, ids in self.seen]
        return w

    @classmethod
    def from_wire(cls, w: dict) -> "LogitAdjust":
        w = {k: [tuple(x) if isinstance(x, list) else x for x in v] for k, v in w.items()}
        w["seen"] = [(j, torch.tensor(ids, dtype=torch.int64)) for j, ids in w["seen"]]
        return cls(**w)

    def to_device(self, device: torch.device) -> "DeviceAdjust":
        """One int64 and one float32 copy to `device` (no wait)."""
        ints = [j for j, _, _ in self.counts] + [i for _, i, _ in self.counts] + [j for j, _ in self.pending] \
            + [r for _, r in self.pending] + [j for j, _, _ in self.bias] + [i for _, i, _ in self.bias] \
            + [j for j, _ in self.ban] + [i for _, i in self.ban]
        seen_rows = [torch.full((len(ids),), j, dtype=torch.int64) for j, ids in self.seen]
        seen_ids = [ids for _, ids in self.seen]
        floats = self.presence + self.frequency + self.repetition + [n for _, _, n in self.counts] \
            + [b for _, _, b in self.bias]
        di = torch.cat([torch.tensor(ints, dtype=torch.int64), *seen_rows, *seen_ids])
        df = torch.tensor(floats, dtype=torch.float32)
        if torch.device(device).type == "cuda":  # pinned: the copies queue behind the step instead of waiting
            di, df = di.pin_memory(), df.pin_memory()
        di, df = di.to(device, non_blocking=True), df.to(device, non_blocking=True)
        S, C, P, B, X = len(self.presence), len(self.counts), len(self.pending), len(self.bias), len(self.ban)
        N = sum(len(ids) for ids in seen_ids)
        i, f = di.split([C, C, P, P, B, B, X, X, N, N]), df.split([S, S, S, C, B])
        return DeviceAdjust(*f[:3], (i[0], i[1]), f[3], (i[2], i[3]), (i[8], i[9]), (i[4], i[5]), f[4], (i[6], i[7]),
                            any(r != 1.0 for r in self.repetition),
                            any(r != 1.0 for r in self.repetition) or any(self.presence) or any(self.frequency))


@dataclass
class DeviceAdjust:
    presence: torch.Tensor  # [S]
    frequency: torch.Tensor  # [S]
    repetition: torch.Tensor  # [S]
    count_at: tuple[torch.Tensor, torch.Tensor]  # ([C] rows, [C] ids)
    count: torch.Tensor  # [C]
    pending_at: tuple[torch.Tensor, torch.Tensor]  # ([P] rows, [P] input rows)
    seen_at: tuple[torch.Tensor, torch.Tensor]  # ([N] rows, [N] ids)
    bias_at: tuple[torch.Tensor, torch.Tensor]  # ([B] rows, [B] ids)
    bias: torch.Tensor  # [B]
    ban_at: tuple[torch.Tensor, torch.Tensor]  # ([X] rows, [X] ids)
    any_repetition: bool
    any_penalty: bool  # a row with a repetition, presence or frequency penalty (else no counts are built)


def adjust_logits(logits: torch.Tensor, adj: DeviceAdjust, input_ids: torch.Tensor) -> torch.Tensor:
    """logits fp32 [S, V] -> a new fp32 [S, V] with the step's changes (LogitAdjust), per row in this order:
    repetition penalty on tokens seen in the prompt or output (HF's: a positive logit divided by it, a negative
    one multiplied), presence and frequency penalties on output tokens (OpenAI's: minus presence once, minus
    frequency times the count), logit_bias added, min_tokens' banned ids at -inf. `input_ids` int64 [T]: the
    step's input rows, where a request's pending output token is read. No host synchronisation."""
    S, V = logits.shape
    logits = logits.clone()
    if adj.any_penalty:
        counts = logits.new_zeros(S, V)
        counts.index_put_(adj.count_at, adj.count, accumulate=True)
        rows, at = adj.pending_at
        counts.index_put_((rows, input_ids.index_select(0, at)), torch.ones_like(rows, dtype=counts.dtype),
                          accumulate=True)
        out = counts > 0
        if adj.any_repetition:
            seen = out.clone()
            seen[adj.seen_at] = True
            rp = adj.repetition[:, None]
            logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
        logits = logits - adj.presence[:, None] * out - adj.frequency[:, None] * counts
    logits.index_put_(adj.bias_at, adj.bias, accumulate=True)
    # a tiny repetition penalty can overflow a logit: the largest finite value instead, so softmax stays a number
    logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf"))
    logits[adj.ban_at] = float("-inf")
    return logits
