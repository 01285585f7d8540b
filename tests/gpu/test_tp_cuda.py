"""Tensor parallelism on two GPUs: a Llama-2-7B-shaped model split over two ranks (NCCL, CUDA graphs
on both, adapters sharded per rank) against Hugging Face transformers + PEFT in fp32, teacher-forced,
with HF's own bf16 run as the tolerance (the rule of test_engine_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from lorafleet.runner.config import EngineConfig
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence
from teacher import flips_against as flips

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]
NEW = 8
TOL = 0.02


def hf_model(path, cfg, adapters, dtype):
    from peft import PeftModel
    from transformers import LlamaConfig, LlamaForCausalLM

    from lorafleet.models import registry
    from lorafleet.runner.model.synthetic import SyntheticReader, synthetic_marker

    hf_cfg = LlamaConfig(**{k: v for k, v in __import__("json").loads((path / "config.json").read_text()).items()
                            if k not in ("model_type", "architectures")})
    with torch.device("meta"):
        m = LlamaForCausalLM(hf_cfg)
    seed, std = synthetic_marker(path)
    w = SyntheticReader(registry.family("llama"), cfg, seed, "cuda:0", torch.bfloat16, std)  # the engine's bf16 weights
    state = {n: w.read(n).to(dtype) for n in sorted(w.names())}
    m.load_state_dict(state, assign=True, strict=False)
    m.model.rotary_emb = type(m.model.rotary_emb)(hf_cfg, device="cuda:0")
    m = m.to(device="cuda:0", dtype=dtype).eval()
    first, *rest = adapters
    pm = PeftModel.from_pretrained(m, str(adapters[first]), adapter_name=first)
    for name in rest:
        pm.load_adapter(str(adapters[name]), adapter_name=name)
    return pm.to(device="cuda:0", dtype=dtype).eval()


def logits_of(pm, ids, name):
    with torch.no_grad():
        x = torch.tensor([ids], device="cuda:0")
        if name is None:
            with pm.disable_adapter():
                return pm(input_ids=x).logits[0].float()
        pm.set_adapter(name)
        return pm(input_ids=x).logits[0].float()


def say(t0, msg):
    import time

    print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)


def test_tp2_7b_shape_matches_hf_fp32_teacher_forced(tmp_path):
    import time

    t0 = time.perf_counter()
    from lorafleet.bench.e2e import LLAMA2_7B, write_peft_adapter
    from lorafleet.models.registry import config_from_hf
    from lorafleet.runner.model.synthetic import synthetic_adapter, write_synthetic_model

    hf = dict(LLAMA2_7B, max_position_embeddings=4096)
    path = write_synthetic_model(tmp_path / "model", hf, seed=3)
    cfg = config_from_hf(hf)
    base = cfg.base_shape()
    ads = {f"s{k}": write_peft_adapter(tmp_path / f"s{k}", synthetic_adapter(f"s{k}", f"synthetic://{k}?rank=16", base,
                                                                              torch.float32), 16) for k in (1, 2)}
    g = torch.Generator().manual_seed(5)
    names = [None, "s1", "s2", "s1", None, "s2"]
    prompts = [torch.randint(3, 32000, (int(torch.randint(10, 50, (1,), generator=g)),), generator=g).tolist()
               for _ in names]
    ref_model = hf_model(path, cfg, ads, torch.float32)
    say(t0, "HF + PEFT fp32 reference built")
    toks, refs = [], []
    for ids, name in zip(prompts, names):  # greedy continuation by the fp32 reference, then its logits
        seq = list(ids)
        for _ in range(NEW):
            seq.append(int(logits_of(ref_model, seq, name)[-1].argmax()))
        toks.append(seq[len(ids):])
        refs.append(logits_of(ref_model, seq, name).cpu())
    del ref_model
    say(t0, "reference tokens and logits done")
    low = hf_model(path, cfg, ads, torch.bfloat16)
    hf_flips = []
    for ids, name, t, ref in zip(prompts, names, toks, refs):
        lg = logits_of(low, ids + t, name).cpu()
        hf_flips += flips(ref, t, len(ids), [int(lg[len(ids) + j - 1].argmax()) for j in range(NEW)])
    del low
    torch.cuda.empty_cache()

    say(t0, "HF bf16 control done")
    eng = Engine(str(path), EngineConfig(tp=2, max_batch_size=64, num_pages=2048, max_lora_rank=16))
    say(t0, "TP=2 engine ready")
    try:
        assert eng.tp is not None and eng.runner.graphs is not None and eng.sgmv.name == "cuda"
        seqs = [Sequence(f"f{i}-{j}", ids + t[:j], SamplingParams(max_tokens=1),
                         AdapterRef(n, str(ads[n])) if n else None)
                for i, (ids, n, t) in enumerate(zip(prompts, names, toks)) for j in range(NEW)]
        out = eng.run_to_completion(seqs)
        say(t0, f"TP=2 engine ran {len(seqs)} teacher-forced requests")
    finally:
        eng.close()
    ours = []
    for i, (ids, t, ref) in enumerate(zip(prompts, toks, refs)):
        ours += flips(ref, t, len(ids), [out[f"f{i}-{j}"].output_ids[0] for j in range(NEW)])
    checked = len(prompts) * NEW
    hf_worst = max((f[1] for f in hf_flips), default=0.0)
    bound = max(TOL, 1.5 * hf_worst)
    print(f"TP=2 bf16 flips {len(ours)}/{checked} (worst {max((f[1] for f in ours), default=0):.4f}); "
          f"HF bf16 flips {len(hf_flips)}/{checked} (worst {hf_worst:.4f})")
    assert not [f for f in ours if f[1] > bound], (ours, bound)
    assert len(ours) <= max(2 * len(hf_flips), checked // 20), (len(ours), len(hf_flips))
