"""Greedy tokens of one mixed multi-LoRA batch equal HF transformers + PEFT, request by request."""

from __future__ import annotations

import pytest

from model_helpers import write_random_adapter
from lorafleet.runner.config import EngineConfig
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence
from reference import HFReference

PROMPTS = [
    "What is the capital of France?",
    "Give me a tip for learning to cook.",
    "Why is the sky blue?",
    "Tell me about dogs.",
    "How do I make tea?",
    "What is gravity?",
]


@pytest.fixture(scope="module")
def smol_adapters(demo_adapters, demo_model, tmp_path_factory):
    """The three demo adapters (ranks 16/8/4, different targets, one rslora) plus one using
    rank_pattern, alpha_pattern and layers_to_transform."""
    extra = write_random_adapter(
        demo_model, tmp_path_factory.mktemp("patterned") / "patterned", r=32, alpha=16,
        targets=("q_proj", "k_proj", "down_proj"), seed=5, scale=0.03,
        rank_pattern={"k_proj": 2}, alpha_pattern={"down_proj": 64}, layers_to_transform=list(range(0, 30, 3)),
    )
    return {"pirate": demo_adapters / "pirate", "shouty": demo_adapters / "shouty", "terse": demo_adapters / "terse",
            "patterned": extra}


def run_engine(model_dir, requests, max_new, **cfg):
    eng = Engine(str(model_dir), EngineConfig(max_batch_size=32, kv_cache_gb=0.25, max_lora_rank=32, **cfg))
    seqs = [Sequence(f"r{i}", ids, SamplingParams(max_tokens=max_new),
                     AdapterRef(name, str(path)) if name else None)
            for i, (ids, name, path) in enumerate(requests)]
    out = eng.run_to_completion(seqs)
    return [out[f"r{i}"] for i in range(len(requests))], eng


def test_smollm2_mixed_batch_equals_hf_peft(demo_model, smol_adapters):
    from lorafleet.scheduler.tokenizer import Tokenizer

    tok = Tokenizer(demo_model)
    names = [None, "pirate", "shouty", "terse", "patterned"]
    requests = []
    for i, p in enumerate(PROMPTS * 2):  # 12 requests over 4 adapters + base, interleaved
        name = names[i % len(names)]
        ids = tok.encode_chat([{"role": "user", "content": p}])
        requests.append((ids, name, smol_adapters.get(name)))
    outs, eng = run_engine(demo_model, requests, max_new=24)
    ref = HFReference(demo_model, smol_adapters)
    mismatches = []
    for (ids, name, _), out in zip(requests, outs):
        assert out.finish_reason in ("stop", "length"), out
        want = ref.greedy(ids, name, 24, eos=2)
        if out.output_ids != want:
            mismatches.append((name, tok.decode(out.output_ids), tok.decode(want)))
    assert not mismatches, mismatches
    # the adapters really change the output (otherwise the test above would prove little)
    texts = {name: tok.decode(o.output_ids) for (_, name, _), o in zip(requests[:5], outs[:5])}
    assert len(set(texts.values())) == 5, texts
    assert eng.blocks.free_pages == eng.blocks.num_pages


def test_random_llama2_shape_equals_hf_peft(tiny_llama, tmp_path):
    adapters = {
        "a16": write_random_adapter(tiny_llama, tmp_path / "a16", r=16, alpha=32,
                                    targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), seed=1),
        "a4": write_random_adapter(tiny_llama, tmp_path / "a4", r=4, alpha=8, targets=("v_proj", "up_proj"), seed=2),
        "a1": write_random_adapter(tiny_llama, tmp_path / "a1", r=1, alpha=1, targets=("o_proj",), seed=3, scale=0.3,
                                   use_rslora=True),
    }
    import torch

    g = torch.Generator().manual_seed(0)
    names = [None, "a16", "a4", "a1"]
    requests = []
    for i in range(14):
        n = int(torch.randint(3, 40, (1,), generator=g))
        ids = torch.randint(3, 512, (n,), generator=g).tolist()
        name = names[i % 4]
        requests.append((ids, name, adapters.get(name)))
    outs, _ = run_engine(tiny_llama, requests, max_new=16, page_size=4)
    ref = HFReference(tiny_llama, adapters)
    for (ids, name, _), out in zip(requests, outs):
        assert out.output_ids == ref.greedy(ids, name, 16, eos=2), name
