"""The prefix cache: requests that share a prompt prefix (and adapter, and cache salt) reuse its full KV
pages and still generate exactly HF transformers + PEFT's greedy tokens; pages are never shared across
adapters, adapter versions or salts; cached pages go before any running request is preempted; a
multi-turn conversation finds its earlier turns; tensor parallelism agrees."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from lorafleet.runner.config import EngineConfig
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence
from model_helpers import write_random_adapter
from reference import HFReference

PS = 4  # page size: many pages in short prompts
NEW = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("pc-adapters")
    return {"a8": write_random_adapter(tiny_llama, d / "a8", r=8, alpha=16, seed=21,
                                       targets=("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")),
            "b4": write_random_adapter(tiny_llama, d / "b4", r=4, alpha=8, seed=22, targets=("v_proj", "up_proj"))}


def engine(model, **cfg) -> Engine:
    return Engine(str(model), EngineConfig(**{"device": "cpu", "max_batch_size": 8, "page_size": PS, "num_pages": 400,
                                              "max_lora_rank": 8, **cfg}))


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def run(eng: Engine, seqs: list[Sequence]) -> dict:
    done = eng.run_to_completion(seqs)
    return {k: v.output_ids for k, v in done.items()}


def seq(i, prompt, adapter=None, ads=None, salt=None, new=NEW):
    return Sequence(f"r{i}", list(prompt), SamplingParams(max_tokens=new, ignore_eos=True),
                    AdapterRef(adapter, str(ads[adapter])) if adapter else None, arrival=float(i), cache_salt=salt)


def prefill_rows(eng: Engine) -> int:
    """Prompt rows the engine computed so far (wraps the batcher's schedule)."""
    return eng._rows


@pytest.fixture
def counted(monkeypatch):
    """Engines made inside count the prompt (non-decode) rows they compute in `_rows`."""
    real = Engine.run_plan

    def run_plan(self, plan, idle_wait=False):
        self._rows = getattr(self, "_rows", 0) + plan.prefill_tokens
        return real(self, plan, idle_wait)

    monkeypatch.setattr(Engine, "run_plan", run_plan)


def test_shared_prefixes_reuse_pages_and_keep_hf_tokens(tiny_llama, adapters, counted):
    """Ten requests over two adapters and the base model share a 41-token system prompt, in two waves:
    the second wave computes only its own suffixes, and every request's tokens equal HF + PEFT's."""
    system = ids(41, 1)
    names = [None, "a8", "b4"]
    wave = lambda k: [seq(k * 10 + i, system + ids(5 + i, 100 + k * 10 + i), names[i % 3], adapters)  # noqa: E731
                      for i in range(5)]
    eng = engine(tiny_llama, max_step_tokens=23)  # chunks that do not align with pages
    got = run(eng, wave(0))
    rows_first = prefill_rows(eng)
    hits_first = eng.blocks.stats["hits"]
    got |= run(eng, wave(1))
    rows_second = prefill_rows(eng) - rows_first
    # the second wave finds the system prompt's 10 full pages for each adapter (and base) it ran on before
    assert eng.blocks.stats["hits"] - hits_first == 5 * 40
    assert rows_second == sum(len(s.prompt_ids) - 40 for s in wave(1))
    ref = HFReference(tiny_llama, adapters)
    for s in wave(0) + wave(1):
        assert got[s.id] == ref.greedy(s.prompt_ids, s.adapter.name if s.adapter else None, NEW, eos=None), s.id
    assert eng.blocks.free_pages == eng.blocks.num_pages  # cached pages count as free


def test_the_cache_off_computes_every_prompt_token(tiny_llama, adapters, counted):
    system = ids(41, 1)
    reqs = [seq(i, system + ids(5, 200 + i)) for i in range(4)]
    eng = engine(tiny_llama, prefix_cache=False)
    run(eng, reqs[:2])
    run(eng, reqs[2:])
    assert prefill_rows(eng) == sum(len(s.prompt_ids) for s in reqs)
    assert eng.blocks.stats["hits"] == 0 and eng.blocks.cached_pages == 0


def test_the_cache_off_counts_no_queries_and_reports_nothing_cached(tiny_llama):
    """With the cache off no prompt is looked up: the query and hit counters (vllm:prefix_cache_queries and
    _hits) stay 0, and every request reports 0 cached tokens (the API's cached_tokens)."""
    system = ids(21, 9)
    eng = engine(tiny_llama, prefix_cache=False)
    reqs = [seq(0, system + [5, 6]), seq(1, system + [7])]
    run(eng, reqs[:1])
    run(eng, reqs[1:])
    pc = eng.state()["prefix_cache"]
    assert not pc["enabled"] and pc["queries"] == 0 and pc["hits"] == 0 and pc["cached_pages"] == 0
    assert [s.cached_tokens for s in reqs] == [0, 0]


def test_pages_are_never_shared_across_adapters_or_salts(tiny_llama, adapters):
    prompt = ids(33, 3)
    eng = engine(tiny_llama)
    for i, (adapter, salt) in enumerate([(None, None), ("a8", None), ("b4", None), (None, "tenant-1"),
                                         ("a8", "tenant-1")]):
        s = seq(i, prompt, adapter, adapters, salt)
        run(eng, [s])
        assert s.cached_tokens == 0, (adapter, salt)  # each a different key root: nothing to find
    again = seq(9, prompt, "a8", adapters, "tenant-1")
    run(eng, [again])
    assert again.cached_tokens == 32  # the same adapter and salt: its 8 full pages


def test_a_rewritten_adapter_never_matches_pages_of_its_old_weights(tiny_llama, tmp_path):
    """Same name and source, new weights on disk (the adapter read again after it left the device pool and the
    host tier): its identity changes with its files, so pages of the old weights are not reused."""
    src = write_random_adapter(tiny_llama, tmp_path / "v", r=4, alpha=8, seed=31, targets=("q_proj", "v_proj"))
    other = write_random_adapter(tiny_llama, tmp_path / "o", r=4, alpha=8, seed=32, targets=("o_proj",))
    ads = {"v": src, "o": other}
    eng = engine(tiny_llama, lora_slots=1, host_lora_cache=1)
    prompt = ids(29, 4)
    first = seq(0, prompt, "v", ads)
    run(eng, [first])
    again = seq(1, prompt, "v", ads)
    run(eng, [again])
    assert again.cached_tokens == 28  # unchanged: reused
    write_random_adapter(tiny_llama, tmp_path / "v", r=4, alpha=8, seed=33, targets=("q_proj", "v_proj"))
    os.utime(src / "adapter_model.safetensors", ns=(time.time_ns(), time.time_ns() + 10**9))
    run(eng, [seq(2, ids(9, 5), "o", ads)])  # takes the one slot and the one host place
    changed = seq(3, prompt, "v", ads)
    out = run(eng, [changed])
    assert changed.cached_tokens == 0
    ref = HFReference(tiny_llama, {"v": src})
    assert out["r3"] == ref.greedy(prompt, "v", NEW, eos=None)


def test_cached_pages_go_before_a_running_request_is_preempted(tiny_llama):
    """A pool that the cache fills: new requests take the cached pages (least recently used first) and
    nobody running is evicted."""
    eng = engine(tiny_llama, num_pages=40, max_batch_size=4)
    run(eng, [seq(i, ids(37, 10 + i)) for i in range(4)])  # 40 pages, most of them cached afterwards
    assert eng.blocks.cached_pages >= 30 and eng.blocks.free_pages == 40
    reqs = [seq(10 + i, ids(30, 50 + i), new=6) for i in range(4)]
    done = eng.run_to_completion(reqs)
    assert all(o.finish_reason == "length" for o in done.values())  # none evicted
    assert eng.blocks.stats["evictions"] > 0


def test_a_second_turn_finds_the_first_turn_and_its_answer(tiny_llama):
    eng = engine(tiny_llama)
    turn1 = seq(0, ids(30, 7), new=13)
    out = run(eng, [turn1])["r0"]
    turn2 = seq(1, turn1.prompt_ids + out + ids(6, 8))
    run(eng, [turn2])
    # the first turn's prompt and answer: 43 tokens with K/V, 10 full pages
    assert turn2.cached_tokens == 40


def test_tp2_with_shared_prefixes_gives_the_tokens_of_one_rank(tiny_llama, adapters):
    system = ids(41, 1)
    reqs = lambda: [seq(i, system + ids(4 + i, 300 + i), [None, "a8", "b4"][i % 3], adapters) for i in range(6)]  # noqa: E731
    outs = []
    for tp in (1, 2):
        eng = engine(tiny_llama, tp=tp, lora_slots=2)
        try:
            first = run(eng, reqs()[:3])
            second = reqs()[3:]
            first |= run(eng, second)
            assert all(s.cached_tokens == 40 for s in second)
            outs.append(first)
        finally:
            eng.close()
    assert outs[0] == outs[1]


def test_engine_state_reports_the_cache(tiny_llama):
    eng = engine(tiny_llama)
    system = ids(21, 9)
    run(eng, [seq(0, system + [5, 6])])
    run(eng, [seq(1, system + [7])])
    pc = eng.state()["prefix_cache"]
    assert pc["enabled"] and pc["queries"] == 23 + 22 and pc["hits"] == 20 and pc["cached_pages"] >= 5
    json.dumps(pc)  # travels in the runner's state


def test_requests_admitted_in_one_step_share_the_pages_it_computes(tiny_llama, adapters, counted):
    """Six requests with one system prompt, submitted together: the first computes the prompt, the five
    admitted beside it in the same step read its pages (written, in every layer, before that layer's
    attention) and compute only their own tokens; every token equals HF + PEFT's."""
    system = ids(41, 11)
    reqs = [seq(i, system + ids(3 + i, 400 + i), "a8", adapters) for i in range(6)]
    eng = engine(tiny_llama)
    got = run(eng, reqs)
    assert prefill_rows(eng) == len(reqs[0].prompt_ids) + sum(len(s.prompt_ids) - 40 for s in reqs[1:])
    assert [s.cached_tokens for s in reqs] == [0] + [40] * 5
    ref = HFReference(tiny_llama, adapters)
    for s in reqs:
        assert got[s.id] == ref.greedy(s.prompt_ids, "a8", NEW, eos=None), s.id
