"""Sampling: greedy limits, per-request seeds independent of the batch, sane distributions."""

from __future__ import annotations

import torch

from lorafleet.runner.engine.sequence import SamplingParams, Sequence
from lorafleet.runner.executor.sampler import pack_sampling, sample_tokens, uniform_for


def sample(logits: torch.Tensor, seqs) -> list[int]:
    """logits fp32 [B, V] (row i belongs to seqs[i], each sampling its position num_tokens) -> ids, as the
    step batch packs each request's parameters and draw."""
    ps = [s.params for s in seqs]
    u = [0.0 if p.greedy else uniform_for(s.sample_seed, s.num_tokens) for s, p in zip(seqs, ps)]
    params = pack_sampling([p.temperature for p in ps], [p.top_p for p in ps], [p.top_k for p in ps], u)
    return sample_tokens(logits, None if params is None else params.to(logits.device)).tolist()


def seq(i, **kw):
    return Sequence(f"s{i}", [1, 2, 3], SamplingParams(**kw))


def test_greedy_and_degenerate_filters_pick_argmax():
    logits = torch.randn(4, 50)
    seqs = [seq(0), seq(1, temperature=1.0, top_k=1, seed=1), seq(2, temperature=0.7, top_p=1e-6, seed=2),
            seq(3, temperature=1e-3, seed=3)]
    assert sample(logits, seqs) == logits.argmax(-1).tolist()


def test_tiny_temperatures_and_huge_logits_stay_greedy():
    """logits / temperature overflowed float32 for temperatures below ~1e-37 (and for a logit at the float32 limit,
    which a penalty can leave), and the draw then landed on an arbitrary token."""
    logits = torch.randn(6, 50) * 4
    logits[5, 7] = torch.finfo(torch.float32).max  # a penalty's clamp can leave one
    temps = [1e-37, 1e-38, 1e-44, 1e-30, 1e-5, 0.5]
    for seed in range(20):
        seqs = [seq(i, temperature=t, seed=seed) for i, t in enumerate(temps)]
        got = sample(logits, seqs)
        assert got == logits.argmax(-1).tolist(), (seed, got)


def test_seeded_draw_independent_of_batch_composition():
    logits = torch.randn(6, 100)
    seqs = [seq(i, temperature=1.0, seed=42) for i in range(6)]
    alone = [sample(logits[i : i + 1], [seqs[i]])[0] for i in range(6)]
    together = sample(logits, seqs)
    assert alone == together


def test_top_k_and_top_p_never_pick_filtered_tokens():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    for s in range(200):
        t = sample(logits, [seq(0, temperature=2.0, top_k=2, seed=s)])[0]
        assert t in (0, 1)
        # p(0) = 0.52, p(1) = 0.19 at T=2: top_p 0.6 keeps exactly those two
        t = sample(logits, [seq(0, temperature=2.0, top_p=0.6, seed=s)])[0]
        assert t in (0, 1)


def test_sampled_frequencies_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    counts = torch.zeros(3)
    for s in range(3000):
        counts[sample(logits, [seq(0, temperature=1.0, seed=s)])[0]] += 1
    freq = counts / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03), freq
