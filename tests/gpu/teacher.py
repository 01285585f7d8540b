"""Teacher-forced checks of a GPU engine against HF transformers + PEFT in fp32, with HF's own run in the
engine's dtype as the tolerance (import from here).

bf16 / fp16 legitimately flip near-ties of the fp32 reference, so every generated position is checked
teacher-forced: the engine predicts the next token after every prefix of the reference continuation.
lorafleet's token may differ from the fp32 reference only where the fp32 margin between the two tokens is
within what HF itself shows in that dtype (or below TOL of the logit range), and at no more positions than
about twice HF's count."""

from __future__ import annotations

import torch

TOL = 0.02  # of the logit range at that position


def hf_logits(model, ads, ids, name, dtype=torch.float32, device="cpu"):
    """Logits at every position through HF transformers + PEFT (eager attention: soft-caps apply there)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32, attn_implementation="eager")
    if name:
        m = PeftModel.from_pretrained(m, str(ads[name]))
    m = m.to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        return m(input_ids=torch.tensor([ids], device=device)).logits[0].float().cpu()


def flips_against(ref_logits, toks, n_prompt, chosen):
    """[(position, fp32 margin / logit range)] where `chosen` differs from the reference tokens."""
    out = []
    for j, got in enumerate(chosen):
        if got != toks[j]:
            row = ref_logits[n_prompt + j - 1]
            out.append((j, float(row[toks[j]] - row[got]) / float(row.max() - row.min())))
    return out


def teacher_forced_check(model, ads, reqs, ref_toks, dtype: str, label: str = "", **engine_cfg):
    """`reqs` [(prompt ids, adapter name, path)], `ref_toks` the fp32 continuation of each; the GPU engine
    (EngineConfig(**engine_cfg), `dtype`) predicts after every prefix. Returns the engine."""
    from lorafleet.runner.config import EngineConfig
    from lorafleet.runner.engine.engine import Engine
    from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence

    new = len(ref_toks[0])
    forced = [(ids + toks[:j], name, path) for (ids, name, path), toks in zip(reqs, ref_toks) for j in range(new)]
    cfg = {"max_lora_rank": 16, "max_batch_size": 64, "num_pages": 4096, **engine_cfg}
    eng = Engine(str(model), EngineConfig(dtype=dtype, **cfg))
    seqs = [Sequence(f"f{k}", ids, SamplingParams(max_tokens=1), AdapterRef(n, str(p)) if n else None)
            for k, (ids, n, p) in enumerate(forced)]
    gpu = eng.run_to_completion(seqs)
    assert eng.attention.name == "flashinfer" and eng.dtype == getattr(torch, dtype)
    ours, hf, checked, k = [], [], 0, 0
    for (ids, name, _), toks in zip(reqs, ref_toks):
        ref = hf_logits(model, ads, ids + toks, name)  # fp32, CPU: [len, V]
        hf_low = hf_logits(model, ads, ids + toks, name, getattr(torch, dtype), "cuda")
        n = len(ids)
        chosen = [gpu[f"f{k + j}"].output_ids[0] for j in range(new)]
        k += new
        checked += new
        ours += [(name,) + f for f in flips_against(ref, toks, n, chosen)]
        hf += [(name,) + f for f in flips_against(ref, toks, n, [int(hf_low[n + j - 1].argmax()) for j in range(new)])]
    hf_worst = max((f[2] for f in hf), default=0.0)
    bound = max(TOL, 1.5 * hf_worst)
    bad = [f for f in ours if f[2] > bound]
    print(f"{label} lorafleet {dtype} flips {len(ours)}/{checked} (worst {max((f[2] for f in ours), default=0):.4f}); "
          f"HF {dtype} flips {len(hf)}/{checked} (worst {hf_worst:.4f})")
    assert not bad, f"{len(bad)} of {checked} positions differ beyond {dtype} noise (bound {bound:.4f}): {bad[:5]}"
    assert len(ours) <= max(2 * len(hf), checked // 20), (len(ours), len(hf))
    return eng
