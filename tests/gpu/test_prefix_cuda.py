"""The prefix cache on the GPU (flashinfer reading shared pages, piecewise and decode graphs) against HF
transformers + PEFT in fp32, teacher-forced with HF's own bf16 run as the tolerance (teacher.py).

Every request opens with the same 64-token system prompt (four full pages) over the base model and two
adapters, and the engine takes at most 8 requests at a time, so most of the 64 forced prompts start after
their prefix's pages were computed by others: their K/V come from the cache (counted, and bounded below)."""

from __future__ import annotations

import pytest
import torch

import teacher
from family_models import family_targets, write_gpu_family_model
from model_helpers import write_random_adapter

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
NEW, SYSTEM = 8, 64


@pytest.mark.parametrize("family", ["llama3", "gemma3"])  # global attention; local windows of 8 + global layers
def test_prefix_cache_on_gpu_matches_hf_fp32_teacher_forced(family, tmp_path):
    from lorafleet.runner.config import EngineConfig
    from lorafleet.runner.engine.engine import Engine
    from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence

    model = write_gpu_family_model(family, tmp_path / "model")
    ads = {"all16": write_random_adapter(model, tmp_path / "all16", r=16, alpha=32, targets=family_targets(family),
                                         seed=5),
           "mlp4": write_random_adapter(model, tmp_path / "mlp4", r=4, alpha=8, targets=family_targets(family, "mlp"),
                                        seed=7)}
    g = torch.Generator().manual_seed(23)
    system = torch.randint(3, 4096, (SYSTEM,), generator=g).tolist()
    names = [None, "all16", "mlp4", "all16"]
    reqs = [(system + torch.randint(3, 4096, (int(torch.randint(5, 30, (1,), generator=g)),), generator=g).tolist(),
             names[i % 4], ads.get(names[i % 4])) for i in range(8)]
    cpu = Engine(str(model), EngineConfig(max_lora_rank=16, device="cpu", kv_cache_gb=0.05))
    out = cpu.run_to_completion([Sequence(f"r{i}", ids, SamplingParams(max_tokens=NEW, ignore_eos=True),
                                          AdapterRef(n, str(p)) if n else None) for i, (ids, n, p) in enumerate(reqs)])
    cont = [out[f"r{i}"].output_ids for i in range(len(reqs))]  # the fp32 continuations (checked against HF below)

    eng = teacher.teacher_forced_check(model, ads, reqs, cont, "bfloat16", f"{family} prefix cache",
                                       prefix_cache=True, max_batch_size=8)
    groups = len(set(names))
    hits = eng.blocks.stats["hits"]
    print(f"{family}: {hits} of {eng.blocks.stats['queries']} prompt tokens from the cache")
    # Every forced prompt but the first of each adapter group finds at least the system prompt's pages.
    assert hits >= (len(reqs) * NEW - groups) * SYSTEM, (hits, eng.blocks.stats)
