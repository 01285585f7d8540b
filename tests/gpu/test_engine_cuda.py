"""The CUDA engine (flashinfer attention, SGMV kernels, decode CUDA graphs, async adapter loads)
against the CPU fp32 reference path, on a SmolLM2-shaped model with mixed adapters.

The shape is SmolLM2-135M's (576 hidden, 9 query / 3 KV heads, tied embeddings, rope_theta
1e5, 30 layers) with random weights. bf16 / fp16 on the GPU legitimately flip near-ties of the
fp32 reference, so each generated position is checked teacher-forced, and the tolerance is not a
guess: Hugging Face transformers + PEFT run in the same dtype on the same GPU over the same
positions is the control. lorafleet's tokens may disagree with the fp32 reference only where the
fp32 margin between the two tokens is within what HF itself shows in that dtype (or below TOL of
the logit range), and not at more positions than about twice HF's count.
"""

from __future__ import annotations

import pytest
import torch

from lorafleet.runner.config import EngineConfig
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence
import teacher
from engine_steps import next_plan_with_prompt_rows
from model_helpers import write_random_adapter, write_random_llama
from teacher import TOL

pytestmark = pytest.mark.gpu
NEW = 12


@pytest.fixture(scope="module")
def smol_shaped(tmp_path_factory):
    d = tmp_path_factory.mktemp("smol-shaped")
    model = write_random_llama(d / "model", hidden=576, layers=30, heads=9, kv_heads=3, inter=1536, vocab=4096,
                               tied=True, std=0.06, rope_theta=100000.0)
    ads = {
        "a16": write_random_adapter(model, d / "a16", r=16, alpha=32, seed=1,
                                    targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
        "a8": write_random_adapter(model, d / "a8", r=8, alpha=8, targets=("q_proj", "v_proj"), seed=2, scale=0.08),
        "a4": write_random_adapter(model, d / "a4", r=4, alpha=8, targets=("gate_proj", "up_proj", "down_proj"),
                                   seed=3, use_rslora=True),
    }
    return model, ads


def requests(ads, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    names = [None, "a16", "a8", "a4"]
    out = []
    for i in range(n):
        ids = torch.randint(3, 4096, (int(torch.randint(5, 60, (1,), generator=g)),), generator=g).tolist()
        name = names[i % 4]
        out.append((ids, name, ads.get(name)))
    return out


def run(model, reqs, **cfg):
    if cfg.get("device") != "cpu":
        cfg.setdefault("num_pages", 4096)  # several engines live in one process: keep each KV pool small
    eng = Engine(str(model), EngineConfig(max_lora_rank=16, **cfg))
    seqs = [Sequence(f"r{i}", ids, SamplingParams(max_tokens=NEW, ignore_eos=True),
                     AdapterRef(n, str(p)) if n else None) for i, (ids, n, p) in enumerate(reqs)]
    out = eng.run_to_completion(seqs)
    assert eng.blocks.free_pages == eng.blocks.num_pages
    return [out[f"r{i}"].output_ids for i in range(len(reqs))], eng


@pytest.fixture(scope="module")
def cpu_reference(smol_shaped):
    model, ads = smol_shaped
    reqs = requests(ads)
    toks, _ = run(model, reqs, device="cpu", kv_cache_gb=0.1)
    return reqs, toks


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_matches_cpu_fp32_teacher_forced(smol_shaped, cpu_reference, dtype):
    teacher_forced_check(smol_shaped, cpu_reference, dtype)


def test_fa2_prefill_matches_cpu_fp32_teacher_forced(smol_shaped, cpu_reference, monkeypatch):
    """LORAFLEET_PREFILL_BACKEND=fa2 (flashinfer's FA2 kernel for prompt rows, which splits the K/V):
    the same check as above, in bf16."""
    monkeypatch.setenv("LORAFLEET_PREFILL_BACKEND", "fa2")
    eng = teacher_forced_check(smol_shaped, cpu_reference, "bfloat16")
    assert eng.attention.prefill_kinds == ("fa2",)
    assert all(s.prefill["fa2"]._backend == "fa2" for s in eng.attention.sets.values())


@pytest.mark.parametrize("kext", [0, 64])
def test_dense_lora_path_matches_cpu_fp32_teacher_forced(smol_shaped, cpu_reference, monkeypatch, kext):
    """LoRA's dense path (runner/lora/step.py), forced onto every prompt step (4 requests per step, no work
    floor): the same check as above, in bf16, with the path's calls counted; kext 0: cuBLAS products per segment
    written before the base GEMM, which accumulates onto them; kext 64: one K-extended GEMM per projection, the
    qkv and gate_up inputs (after layer 0) normalized in place inside the previous projection's wide output."""
    from lorafleet.runner.config import KernelChoices
    from lorafleet.runner.lora import step as lora_step

    calls, wide_inputs, kcalls = [], [], []
    real, kreal = lora_step.LoraStepImpl.dense_linear, lora_step.LoraStepImpl._kext_linear

    def counted(self, layer, group, x, w, bias, **kw):
        calls.append(group)
        if x.stride(0) > x.shape[1]:
            wide_inputs.append((layer, group))
        return real(self, layer, group, x, w, bias, **kw)

    monkeypatch.setattr(lora_step.LoraStepImpl, "dense_linear", counted)
    monkeypatch.setattr(lora_step.LoraStepImpl, "_kext_linear",
                        staticmethod(lambda *args: kcalls.append(1) or kreal(*args)))
    model, ads = smol_shaped
    reqs, cpu = cpu_reference
    teacher.teacher_forced_check(model, ads, reqs, cpu, "bfloat16", f"smol-shaped dense kext={kext}",
                                 max_batch_size=4,
                                 kernels=KernelChoices(dense_lora_rows=1, dense_lora_min_work=1, dense_lora_kext=kext))
    assert set(calls) == {0, 1, 2, 3}
    assert (len(kcalls) > 0) == (kext > 0)
    if kext:
        assert {g for _, g in wide_inputs} == {0, 2} and all(layer > 0 or g == 2 for layer, g in wide_inputs)
    else:
        assert not wide_inputs


def teacher_forced_check(smol_shaped, cpu_reference, dtype):
    """The GPU engine's next token after every prefix of the CPU fp32 engine's output, against HF + PEFT
    in fp32; HF's own `dtype` run sets the tolerance (teacher.py). Returns the engine."""
    model, ads = smol_shaped
    reqs, cpu = cpu_reference
    eng = teacher.teacher_forced_check(model, ads, reqs, cpu, dtype, "smol-shaped")
    assert eng.sgmv.name == "cuda"
    return eng


@pytest.mark.parametrize("qkv_expand_in_rope", [False, True])
def test_graph_replay_equals_eager(smol_shaped, qkv_expand_in_rope, monkeypatch):
    """Decode graphs give the tokens of eager steps, also with the qkv LoRA expand inside the rope_kv
    kernel (LORAFLEET_ROPE_KV_LORA=1), which must add it in the expand's own order."""
    model, ads = smol_shaped
    reqs = requests(ads, n=20, seed=4)
    monkeypatch.setenv("LORAFLEET_ROPE_KV_LORA", "1" if qkv_expand_in_rope else "0")
    monkeypatch.setenv("LORAFLEET_BF16_SM90", "0")  # else Hopper's qkv expand is inside the wgmma product
    graphed, eng = run(model, reqs, max_batch_size=32)
    assert eng.runner.graphs is not None
    assert all(st.lora.qkv_expand_in_rope == qkv_expand_in_rope for st in eng.runner.graphs.static.values())
    eager, eng2 = run(model, reqs, max_batch_size=32, cuda_graphs=False)
    assert eng2.runner.graphs is None
    same = sum(a == b for a, b in zip(graphed, eager))
    assert same == len(reqs), f"{len(reqs) - same} of {len(reqs)} requests differ between graph replay and eager"


# Kernel choices of the few-slots test: the defaults (the early norm among them), flashinfer's norm before the wgmma
# products (LORAFLEET_NORM_EARLY=0), every bf16 product on cuBLAS (no wgmma kernel, no LoRA inside it).
FEW_SLOTS_KERNELS = {"defaults": {}, "norm_late": {"LORAFLEET_NORM_EARLY": "0"},
                     "cublas": {"LORAFLEET_BF16_SM90": "0"}}


@pytest.mark.parametrize("kernels", list(FEW_SLOTS_KERNELS))
def test_async_adapter_loads_with_few_slots(smol_shaped, kernels, monkeypatch):
    """Two slots for three adapters: loads and evictions happen while the batch runs. Every request's free-running
    tokens, with two slots and with eight, against HF + PEFT in fp32 along those same tokens
    (teacher.free_run_check): a row that read another adapter's weights, or a slot's while it was being refilled,
    would put its token far outside bf16's noise.
    Not asserted: the same tokens with two slots and with eight, or in two runs alike. The loads are asynchronous, so
    the steps differ from run to run, and a request's rows depend on their step's neighbours: decode rows in a step of
    more than 64 rows (SM90_MAX_ROWS) take cuBLAS's products, in a smaller step the wgmma kernel, and the two round
    differently, so a near-tie may go either way (docs/perf_notes.md, eighteenth session)."""
    for name, value in FEW_SLOTS_KERNELS[kernels].items():
        monkeypatch.setenv(name, value)
    model, ads = smol_shaped
    reqs = requests(ads, n=16, seed=7)
    small, eng = run(model, reqs, max_batch_size=32, lora_slots=2)
    assert eng.adapters.stats["evictions"] > 0
    assert eng.model.norm_early == (kernels == "defaults")
    big, _ = run(model, reqs, max_batch_size=32, lora_slots=8)
    teacher.free_run_check(model, ads, reqs, small, "bfloat16", f"few slots ({kernels}), two slots")
    teacher.free_run_check(model, ads, reqs, big, "bfloat16", f"few slots ({kernels}), eight slots")


def test_piecewise_mixed_step_matches_eager(smol_shaped):
    """A step with prefill and decode rows through the piecewise CUDA graphs (padded to a bucket)
    against the same step run eagerly: same logits up to bf16 GEMM-shape noise, same argmax."""
    from lorafleet.runner.engine.step_batch import to_device
    from lorafleet.runner.engine.step_batch import build_step_batch

    model, ads = smol_shaped
    eng = Engine(str(model), EngineConfig(max_lora_rank=16, max_batch_size=32, num_pages=4096, overlap=False))
    assert eng.runner.mixed is not None and eng.runner.mixed.use_graphs
    reqs = requests(ads, n=12, seed=9)
    for i, (ids, n, p) in enumerate(reqs[:8]):
        eng.submit(Sequence(f"a{i}", ids, SamplingParams(max_tokens=20, ignore_eos=True),
                            AdapterRef(n, str(p)) if n else None, arrival=float(i)))
    for _ in range(30):  # until all eight decode (adapter loads are asynchronous)
        eng.step()
        if len(eng.batcher.running) == 8 and not any(s.num_cached == 0 for s in eng.batcher.running):
            break
    for i, (ids, n, p) in enumerate(reqs[8:]):
        eng.submit(Sequence(f"b{i}", ids, SamplingParams(max_tokens=4, ignore_eos=True),
                            AdapterRef(n, str(p)) if n else None, arrival=100.0 + i))
    plan = next_plan_with_prompt_rows(eng)
    assert plan.prefill_tokens and plan.num_decode
    batch = build_step_batch(plan.work, eng.config.page_size, 32, pin=True)
    got = eng.runner.mixed.run(batch, to_device(batch, eng.device, None)).clone()
    ref = eng.runner.forward(batch, to_device(batch, eng.device, None))
    span = (ref.max(-1).values - ref.min(-1).values)[:, None]
    rel = ((got - ref).abs() / span).max().item()
    same = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"piecewise vs eager: max |diff| {rel:.4f} of the logit range, argmax agreement {same:.3f}")
    assert rel < TOL and same >= 0.9


def test_a_step_queues_without_waiting_for_the_device(smol_shaped):
    """With overlap, queueing a step never waits for the device: not when a prompt chunk in the step
    samples nothing (its rows are left out of sampling on the device) and not with temperature sampling
    (its parameters travel with the step's other numbers). A long kernel stands in for the step in flight."""
    import time

    model, ads = smol_shaped
    eng = Engine(str(model), EngineConfig(max_lora_rank=16, max_batch_size=8, num_pages=4096, max_step_tokens=24))
    g = torch.Generator().manual_seed(3)
    for i in range(4):
        eng.submit(Sequence(f"t{i}", torch.randint(3, 4096, (12,), generator=g).tolist(),
                            SamplingParams(max_tokens=200, temperature=0.8, top_p=0.9, top_k=50, seed=i,
                                           ignore_eos=True)))
    for _ in range(20):
        eng.step()
    long = Sequence("long", torch.randint(3, 4096, (300,), generator=g).tolist(),  # the context is 512
                    SamplingParams(max_tokens=2, ignore_eos=True))
    eng.submit(long)
    for _ in range(100):  # until its prompt is being prefilled in chunks
        eng.step()
        if long in eng.batcher.running and 0 < long.num_cached < 100:
            break
    assert long in eng.batcher.running and long.prefilling
    for _ in range(6):  # steps carrying a chunk of the long prompt, which samples nothing
        eng.step()
        torch.cuda.synchronize()
        busy = time.perf_counter()
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of queued GPU work
        eng.step()
        queued = time.perf_counter() - busy
        batch = eng._inflight.batch  # the step just queued
        torch.cuda.synchronize()
        total = time.perf_counter() - busy
        assert total > 0.15, f"the stand-in kernel ran only {total:.2f} s; the test needs a longer one"
        assert queued < total / 3, f"queueing a step took {queued:.2f} s of {total:.2f} s: it waited"
        assert len(batch.sample_idx) < batch.batch_size and batch.packedf is not None  # the case under test
    while eng.has_work():
        eng.step()


def test_prefer_cublaslt_runs_the_gemm_and_restores_the_backend():
    """The o and down GEMMs of small steps run inside `prefer_cublaslt`: the product matches an fp32
    reference to bf16 rounding, and torch's preferred BLAS backend is restored afterwards, also when the
    body raises."""
    import torch.nn.functional as F

    from lorafleet.runner.model.ops import prefer_cublaslt

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(32, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(11008, 4096, device="cuda", generator=gen) / 64).to(torch.bfloat16)  # [out, in]
    before = torch.backends.cuda.preferred_blas_library()
    with prefer_cublaslt():
        assert torch.backends.cuda.preferred_blas_library().name.lower() == "cublaslt"
        y = F.linear(x, w)
    assert torch.backends.cuda.preferred_blas_library() == before
    ref = x.float() @ w.float().T
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
    with pytest.raises(RuntimeError, match="inside"):
        with prefer_cublaslt():
            raise RuntimeError("inside")
    assert torch.backends.cuda.preferred_blas_library() == before
