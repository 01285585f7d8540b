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


def hf_logits(model, ads, ids, name, dtype=torch.float32, device="cpu", emulate=None):
    """Logits at every position through HF transformers + PEFT (eager attention: soft-caps apply there);
    `emulate(model)`, a context manager, wraps the forward (e.g. fp8_reference.emulate_fp8)."""
    import contextlib

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32, attn_implementation="eager")
    if name:
        m = PeftModel.from_pretrained(m, str(ads[name]))
    m = m.to(device=device, dtype=dtype).eval()
    with torch.no_grad(), (emulate(m) if emulate else contextlib.nullcontext()):
        return m(input_ids=torch.tensor([ids], device=device)).logits[0].float().cpu()


def flips_against(ref_logits, toks, n_prompt, chosen):
    """[(position, fp32 margin / logit range)] where `chosen` differs from the reference tokens."""
    out = []
    for j, got in enumerate(chosen):
        if got != toks[j]:
            row = ref_logits[n_prompt + j - 1]
            out.append((j, float(row[toks[j]] - row[got]) / float(row.max() - row.min())))
    return out


def teacher_forced_check(model, ads, reqs, ref_toks, dtype: str, label: str = "", ref_model=None, emulate=None,
                         **engine_cfg):
    """`reqs` [(prompt ids, adapter name, path)], `ref_toks` the fp32 continuation of each; the GPU engine
    (EngineConfig(**engine_cfg), `dtype`) predicts after every prefix. The reference (fp32 on the CPU, and
    in `dtype` on the GPU for the tolerance) is HF on `ref_model` (default: `model`) under `emulate` (see
    hf_logits). Returns the engine."""
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
    chosen = [[gpu[f"f{i * new + j}"].output_ids[0] for j in range(new)] for i in range(len(reqs))]
    judge(model, ads, reqs, ref_toks, chosen, dtype, label, ref_model, emulate)
    return eng


def free_run_check(model, ads, reqs, toks, dtype: str, label: str = "", emulate=None):
    """A free run's tokens `toks` (per request, what the engine generated greedily) against HF + PEFT in fp32 along
    those same tokens: at every position the engine's token is HF's argmax after the same prefix, or within what HF's
    own `dtype` run shows (judge; both HF runs under `emulate`, see hf_logits)."""
    judge(model, ads, reqs, toks, toks, dtype, label, emulate=emulate, free=True)


def judge(model, ads, reqs, along, chosen, dtype: str, label: str, ref_model=None, emulate=None, free=False):
    """Each request's `chosen` tokens (one per position) after the prefixes prompt + `along`[:j], against HF's fp32
    logits there: where a token is not the reference's, the fp32 margin between them must be within what HF's own
    `dtype` run shows (or TOL), at no more than about twice HF's count of positions. The reference token at position
    j is `along`[j] (teacher forcing along the reference continuation) or, with `free`, HF fp32's argmax there (a free
    run, `along` the engine's own tokens)."""
    ours, hf, checked = [], [], 0
    for (ids, name, _), toks, got in zip(reqs, along, chosen):
        ref = hf_logits(ref_model or model, ads, ids + toks, name, emulate=emulate)  # fp32, CPU: [len, V]
        hf_low = hf_logits(ref_model or model, ads, ids + toks, name, getattr(torch, dtype), "cuda", emulate)
        n, new = len(ids), len(toks)
        want = [int(ref[n + j - 1].argmax()) for j in range(new)] if free else toks
        checked += new
        ours += [(name,) + f for f in flips_against(ref, want, n, got)]
        hf += [(name,) + f for f in flips_against(ref, want, n, [int(hf_low[n + j - 1].argmax()) for j in range(new)])]
    hf_worst = max((f[2] for f in hf), default=0.0)
    bound = max(TOL, 1.5 * hf_worst)
    bad = [f for f in ours if f[2] > bound]
    print(f"{label} lorafleet {dtype} flips {len(ours)}/{checked} (worst {max((f[2] for f in ours), default=0):.4f}); "
          f"HF {dtype} flips {len(hf)}/{checked} (worst {hf_worst:.4f})")
    assert not bad, f"{len(bad)} of {checked} positions differ beyond {dtype} noise (bound {bound:.4f}): {bad[:5]}"
    assert len(ours) <= max(2 * len(hf), checked // 20), (len(ours), len(hf))


def cpu_continuations(model, reqs, new: int) -> list[list[int]]:
    """The fp32 CPU engine's greedy continuation (`new` tokens) of each of `reqs` [(prompt ids, adapter name, path)]:
    the tokens a GPU engine is then teacher-forced along (teacher_forced_check)."""
    from lorafleet.runner.config import EngineConfig
    from lorafleet.runner.engine.engine import Engine
    from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence

    cpu = Engine(str(model), EngineConfig(max_lora_rank=16, device="cpu", kv_cache_gb=0.05))
    seqs = [Sequence(f"r{i}", ids, SamplingParams(max_tokens=new, ignore_eos=True), AdapterRef(n, str(p)) if n else None)
            for i, (ids, n, p) in enumerate(reqs)]
    out = cpu.run_to_completion(seqs)
    return [out[f"r{i}"].output_ids for i in range(len(reqs))]


def family_teacher_forced(fam, label: str, new: int, **engine_cfg):
    """teacher_forced_check of `fam` = (family name, model, adapters, requests) along the fp32 CPU engine's `new`
    tokens (cpu_continuations), for a GPU engine of EngineConfig(**engine_cfg) in bf16. Returns the engine."""
    name, model, ads, reqs = fam
    toks = cpu_continuations(model, reqs, new)
    return teacher_forced_check(model, ads, reqs, toks, "bfloat16", f"{name} {label}", **engine_cfg)


def count_calls(monkeypatch, cls, name: str) -> list:
    """`cls.name` wrapped (through `monkeypatch`) to append 1 to the returned list at each call, then run as before."""
    calls = []
    real = getattr(cls, name)

    def counting(self, *args, **kw):
        calls.append(1)
        return real(self, *args, **kw)

    monkeypatch.setattr(cls, name, counting)
    return calls


def decode_graph_vs_eager(model, reqs, label: str = "", **cfg):
    """A decode step of 24 requests (`reqs` three times: [(prompt ids, adapter name, path)]) replayed from its
    CUDA graph against the same step run eagerly (EngineConfig(**cfg)): the same logits up to bf16
    kernel-choice noise (TOL of the logit range) and the same argmax at 90 % of rows or more."""
    eng, batch = decode_step(model, reqs, **cfg)
    assert eng.runner.graphs.bucket(batch.batch_size) is not None
    got = eng.runner.graphs.run(batch, batch.to_device(eng.device)).clone()
    ref = eng.runner.forward(batch, batch.to_device(eng.device))
    span = (ref.max(-1).values - ref.min(-1).values)[:, None]
    rel = ((got - ref).abs() / span).max().item()
    same = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{label} decode graph vs eager: max |diff| {rel:.4f} of the logit range, argmax agreement {same:.3f}")
    assert rel < TOL and same >= 0.9
    return eng


def decode_kernel_vs_flashinfer(model, reqs, label: str = "", min_agree: float | None = 0.9, **cfg):
    """A decode step of 24 requests on the project's decode attention kernel (KernelChoices.decode_kernel, eager)
    against the same step on flashinfer's decode kernel, and its graph replay against its eager step: the same
    logits up to bf16 kernel-choice noise (TOL of the logit range) and the same argmax at 90 % of rows or more
    (against flashinfer: at `min_agree` of them; None: not asked, for a kernel whose rounding differs from
    flashinfer's by design, whose tokens the caller judges against an fp32 reference instead).
    `cfg["kernels"]` must choose the project's kernel. Returns the engine."""
    eng, batch = decode_step(model, reqs, **cfg)
    own = eng.attention.own
    assert own is not None, "the project's decode kernel was not taken"
    d = batch.to_device(eng.device)
    ours = eng.runner.forward(batch, d).clone()
    eng.attention.own = None  # the same step's decode rows on flashinfer's kernel
    try:
        theirs = eng.runner.forward(batch, d).clone()
    finally:
        eng.attention.own = own
    replay = eng.runner.graphs.run(batch, d).clone()
    span = (theirs.max(-1).values - theirs.min(-1).values)[:, None]
    for name, got in (("against flashinfer", ours), ("graph replay against eager", replay)):
        ref = theirs if name == "against flashinfer" else ours
        rel = ((got - ref).abs() / span).max().item()
        same = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"{label} lorafleet decode {name}: max |diff| {rel:.4f} of the logit range, argmax agreement {same:.3f}")
        floor = 0.9 if name != "against flashinfer" else min_agree
        assert rel < TOL and (floor is None or same >= floor), name
    return eng


def decode_step(model, reqs, **cfg):
    """An engine (EngineConfig(**cfg), CUDA graphs on) with the requests `reqs` three times ([(prompt ids, adapter
    name, path)]) prefilled and decoding, and the host batch of its next step: 24 decode rows, no prompt rows."""
    from lorafleet.runner.config import EngineConfig
    from lorafleet.runner.engine.engine import Engine
    from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence
    from lorafleet.runner.engine.step_batch import build_step_batch

    eng = Engine(str(model), EngineConfig(max_lora_rank=16, max_batch_size=32, num_pages=2048, overlap=False, **cfg))
    assert eng.runner.graphs is not None
    for i, (ids, n, p) in enumerate(reqs * 3):
        eng.submit(Sequence(f"r{i}", ids, SamplingParams(max_tokens=64, ignore_eos=True),
                            AdapterRef(n, str(p)) if n else None, arrival=float(i)))
    for _ in range(200):  # until all 24 decode (adapter loads are asynchronous)
        eng.step()
        if len(eng.batcher.running) == 24 and not any(s.prefilling for s in eng.batcher.running):
            break
    eng._drain_inbox()
    plan = eng.batcher.schedule()
    assert plan.num_decode == 24 and not plan.prefill_tokens
    return eng, build_step_batch(plan.work, eng.config.page_size, 32, pin=True)


def family_with_two_adapters(name: str, d):
    """A GPU-sized random model of family `name` in d / "model", a rank-16 adapter on every projection and a rank-4
    one on the MLP, and six requests [(prompt ids, adapter name or None, path)] over them and the base model."""
    from family_models import family_targets, write_gpu_family_model
    from model_helpers import write_random_adapter

    model = write_gpu_family_model(name, d / "model")
    ads = {"all16": write_random_adapter(model, d / "all16", r=16, alpha=32, targets=family_targets(name), seed=5),
           "mlp4": write_random_adapter(model, d / "mlp4", r=4, alpha=8, targets=family_targets(name, "mlp"), seed=7)}
    g = torch.Generator().manual_seed(17)
    names = [None, "all16", "mlp4"]
    reqs = [(torch.randint(3, 4096, (int(torch.randint(20, 60, (1,), generator=g)),), generator=g).tolist(),
             names[i % 3], ads.get(names[i % 3])) for i in range(6)]
    return model, ads, reqs
