"""Every supported family on the GPU (flashinfer attention with the window per layer, SGMV kernels, decode
and piecewise CUDA graphs) against HF transformers + PEFT in fp32, teacher-forced, with HF's own bf16 run as
the tolerance (teacher.py); and graph replay against eager steps, token for token.

The models are the CPU family tests' (tests/family_models.py) at a GPU-sized width: heads of 128 (the size
the released checkpoints use), windows of 8 tokens under prompts of 20 to 60."""

from __future__ import annotations

import functools

import pytest
import torch

import teacher
from family_models import FAMILIES, family_targets, write_gpu_family_model
from fp8_reference import emulate_fp8
from lorafleet.runner.config import EngineConfig, KernelChoices
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence
from lorafleet.runner.model.rope_kv import FusedKvWriter
from model_helpers import write_random_adapter

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
NEW = 8


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    d = tmp_path_factory.mktemp(f"gpu-{name}")
    model = write_gpu_family_model(name, d / "model")
    ads = {
        "all16": write_random_adapter(model, d / "all16", r=16, alpha=32, targets=family_targets(name), seed=5),
        "attn8": write_random_adapter(model, d / "attn8", r=8, alpha=8, targets=family_targets(name, "attn"), seed=6,
                                      scale=0.08),
        "mlp4": write_random_adapter(model, d / "mlp4", r=4, alpha=8, targets=family_targets(name, "mlp"), seed=7,
                                     use_rslora=True),
    }
    g = torch.Generator().manual_seed(17)
    names = [None, "all16", "attn8", "mlp4"]
    reqs = [(torch.randint(3, 4096, (int(torch.randint(20, 60, (1,), generator=g)),), generator=g).tolist(),
             names[i % 4], ads.get(names[i % 4])) for i in range(8)]
    return name, model, ads, reqs


def generate(model, reqs, new, **cfg):
    eng = Engine(str(model), EngineConfig(max_lora_rank=16, **cfg))
    seqs = [Sequence(f"r{i}", ids, SamplingParams(max_tokens=new, ignore_eos=True),
                     AdapterRef(n, str(p)) if n else None) for i, (ids, n, p) in enumerate(reqs)]
    out = eng.run_to_completion(seqs)
    assert eng.blocks.free_pages == eng.blocks.num_pages
    return [out[f"r{i}"].output_ids for i in range(len(reqs))], eng


def test_family_on_gpu_matches_hf_fp32_teacher_forced(family):
    name, model, ads, reqs = family
    cpu, _ = generate(model, reqs, NEW, device="cpu", kv_cache_gb=0.05)  # the fp32 continuation
    eng = teacher.teacher_forced_check(model, ads, reqs, cpu, "bfloat16", name)
    assert eng.sgmv.name == "cuda" and eng.runner.mixed is not None  # prompt steps replayed piecewise


def test_family_decode_graph_replay_matches_the_eager_step(family):
    """A decode step of 24 requests over the three adapters and the base model, replayed from its CUDA graph
    (windows per layer in the graph's decode wrappers, padded rows on the scratch page), against the same
    step run eagerly: the same logits up to bf16 kernel-choice noise and the same argmax. (Steps with prompt
    rows go through the piecewise graphs in the teacher-forced test above, whose forced prompts are all
    prefills. Token-for-token equality over whole runs is too strict for these random models: HF's own bf16
    run flips up to 10 of 64 positions of their fp32 run.)"""
    name, model, _, reqs = family
    teacher.decode_graph_vs_eager(model, reqs, name)


def test_family_decode_on_the_lorafleet_kernel(family):
    """The project's decode attention kernel (LORAFLEET_DECODE_KERNEL=lorafleet) in a decode step of 24 requests,
    with the family's windows, grouping and softmax scale (no GPU family model has an attention soft-cap:
    test_decode_attn_cuda.py checks it): against flashinfer's decode kernel on the same step, and its graph replay
    against its eager step."""
    name, model, _, reqs = family
    teacher.decode_kernel_vs_flashinfer(model, reqs, name, kernels=KernelChoices(decode_kernel="lorafleet"))


def test_family_decode_on_the_tensor_core_kernel_with_fp8_pages(family):
    """The project's decode kernel on the tensor cores (KernelChoices.decode_mma) over e4m3 pages, with the family's
    windows, grouping and softmax scale. Against flashinfer's decode on the same step's FP8 pages: the logits within
    TOL of the range. Their argmax is not compared there: the tensor cores take p · v with the probabilities rounded
    to f16, where flashinfer's CUDA-core decode keeps them in fp32, and these random models' near-ties flip under that
    (H100, 2026-12-07: 3 to 6 of 24 rows for phi3, qwen2 and qwen3 at 1 % of the range). Instead a free run's every
    token is judged against HF + PEFT in fp32 with K and V rounded through e4m3, HF's own bf16 run under the same
    rounding as the tolerance. And the kernel's graph replay against its eager step."""
    name, model, ads, reqs = family
    kernels = KernelChoices(decode_kernel="lorafleet", decode_mma=True)
    eng = teacher.decode_kernel_vs_flashinfer(model, reqs, f"{name} tensor cores", min_agree=None,
                                              kv_cache_dtype="fp8", kernels=kernels)
    assert eng.attention.own.mma and eng.attention.own.stages == 3
    del eng
    toks, run = generate(model, reqs, NEW, kv_cache_dtype="fp8", kernels=kernels)
    assert run.attention.own is not None and run.attention.own.mma and run.kv.k.dtype == torch.float8_e4m3fn
    teacher.free_run_check(model, ads, reqs, toks, "bfloat16", f"{name} tensor cores, FP8 pages, free run",
                           emulate=functools.partial(emulate_fp8, activations=False, kv=True))


def test_family_bf16_products_on_the_wgmma_kernel(family, monkeypatch):
    """KernelChoices.bf16_sm90: the products of steps of at most 64 rows on the wgmma kernel with bf16 operands, the
    bias and the rows' LoRA expand inside its epilogue after the group's shrink. Teacher-forced against HF + PEFT in
    fp32 with every step at most 64 rows, so that every product takes the kernel (its calls counted, some with LoRA
    operands); then a decode step of 24 requests replayed from its CUDA graph against the same step run eagerly, also
    with the shrinks of qkv and gate_up inside the norms' launches (KernelChoices.norm_shrink)."""
    import lorafleet.runner.model.decoder as dec

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel is built for compute capability 9.0 only")
    name, model, ads, reqs = family
    calls = []
    real = dec.bf16_sm90_linear

    def counted(ext, x, w, bias, spans, lora, unit, sync=None):
        calls.append((len(spans), lora is not None, w.shape[0]))
        return real(ext, x, w, bias, spans, lora, unit, sync)
    monkeypatch.setattr(dec, "bf16_sm90_linear", counted)
    cpu, _ = generate(model, reqs, NEW, device="cpu", kv_cache_gb=0.05)  # the fp32 continuation
    eng = teacher.teacher_forced_check(model, ads, reqs, cpu, "bfloat16", f"{name} bf16 wgmma",
                                       kernels=KernelChoices(bf16_sm90=True, sm90_shrink=False), max_step_tokens=64)
    assert eng.model.bf16_sm90 and any(lora for _, lora, _ in calls)
    # every product of every layer and step took it: qkv (three spans), o and down (one), gate_up (two) alike, and
    # each step's lm_head (one span of the vocabulary's rows)
    vocab = eng.model.lm_head.shape[0]
    heads = sum(1 for n, _, rows in calls if n == 1 and rows == vocab)
    qkv, one, two = (sum(1 for n, _, rows in calls if n == k and rows != vocab) for k in (3, 1, 2))
    assert qkv > 0 and qkv % eng.model.num_layers == 0 and one == 2 * qkv and two == qkv
    assert heads >= qkv // eng.model.num_layers
    teacher.decode_graph_vs_eager(model, reqs, f"{name} bf16 wgmma",
                                  kernels=KernelChoices(bf16_sm90=True, sm90_shrink=False))
    # with the qkv and gate_up shrinks inside the norms' launches (the product then launches no shrink of its own)
    teacher.decode_graph_vs_eager(model, reqs, f"{name} bf16 wgmma, norm + shrink",
                                  kernels=KernelChoices(bf16_sm90=True, norm_shrink=True))


@pytest.mark.parametrize("producer", [False, True, "first"], ids=["consumers", "producer", "shrink_first"])
def test_family_shrink_inside_the_wgmma_product(family, monkeypatch, producer):
    """KernelChoices.sm90_shrink: the rows' LoRA shrink inside the same wgmma launch as the product and the expand, no
    LoRA launch of its own left but each step's first shrink (between the row slots' ops and the first product).
    Teacher-forced against HF + PEFT in fp32 (every step at most 64 rows; the calls with A pools and the shrinks
    launched counted), the counters zero after the run, then a decode step replayed from its CUDA graph against the
    same step run eagerly. `producer` (KernelChoices.sm90_shrink_producer): the producer warp group's warps take the
    shrink's tickets beside the main loop; a decode step then gives the consumers' bits, on one engine. "first"
    (KernelChoices.sm90_shrink_first): every product with A pools in two launches (the shrink first on the producer's
    warps, then the FP8 epilogue's launch with the expand, gate_up's also applying the activation); a decode step then
    gives the bits of the one launch and flashinfer's act_and_mul."""
    import lorafleet.runner.model.decoder as dec
    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel is built for compute capability 9.0 only")
    name, model, ads, reqs = family
    inside, shrinks = [], []
    real = dec.bf16_sm90_linear

    def counted(ext, x, w, bias, spans, lora, unit, sync=None, **kw):
        inside.append(lora is not None and lora[4] is not None and sync is not None)
        assert kw.get("shrink_producer", False) == (producer is True and inside[-1])
        assert not (producer == "first" and inside[-1])  # (those take the two launches)
        return real(ext, x, w, bias, spans, lora, unit, sync, **kw)
    monkeypatch.setattr(dec, "bf16_sm90_linear", counted)
    real_first = dec.bf16_sm90_shrink_first

    def counted_first(ext, x, w, bias, spans, lora, unit, sync, act=0):
        assert producer == "first" and sync is not None and (act or lora[4] is not None)
        inside.append(lora is not None and lora[4] is not None)
        return real_first(ext, x, w, bias, spans, lora, unit, sync, act=act)
    monkeypatch.setattr(dec, "bf16_sm90_shrink_first", counted_first)
    real_shrink = CudaSGMV.shrink
    monkeypatch.setattr(CudaSGMV, "shrink", lambda self, *a, **k: shrinks.append(1) or real_shrink(self, *a, **k))
    cpu, _ = generate(model, reqs, NEW, device="cpu", kv_cache_gb=0.05)  # the fp32 continuation
    kernels = KernelChoices(bf16_sm90=True, sm90_shrink=True, sm90_shrink_producer=producer is True,
                            sm90_shrink_first=producer == "first")
    label = f"{name} shrink in wgmma" + {False: "", True: " (producer warps)",
                                         "first": " (shrink first, the epilogue's launch)"}[producer]
    eng = teacher.teacher_forced_check(model, ads, reqs, cpu, "bfloat16", label, kernels=kernels, max_step_tokens=64)
    assert eng.model.sm90_sync is not None and not eng.model.sm90_sync.any()
    layers = eng.model.num_layers
    assert shrinks and sum(inside) >= (4 * layers - 1) * len(shrinks), (sum(inside), len(shrinks))
    teacher.decode_graph_vs_eager(model, reqs, label, kernels=kernels)
    if producer:  # the same step on one engine, the tickets on the consumer warps, then on the producer's
        monkeypatch.setattr(dec, "bf16_sm90_linear", real)
        monkeypatch.setattr(dec, "bf16_sm90_shrink_first", real_first)
        # (the one launch, the default before sm90_shrink_first)
        first = KernelChoices(bf16_sm90=True, sm90_shrink=True, sm90_shrink_first=False)
        eng, batch = teacher.decode_step(model, reqs, kernels=first)
        dev = batch.to_device(eng.device)
        try:
            consumers = eng.runner.forward(batch, dev).clone()
            eng.model.sm90_shrink_producer = producer is True
            eng.model.sm90_shrink_first = producer == "first"
            assert torch.equal(eng.runner.forward(batch, dev), consumers), name
            assert not eng.model.sm90_sync.any()
        finally:
            eng.close()


def test_family_early_norm_before_the_wgmma_products(family):
    """KernelChoices.norm_early: the norms before qkv and gate_up on the project's kernel, letting the wgmma product
    after each start at once. Teacher-forced against HF + PEFT in fp32 (every step at most 64 rows), then a decode step
    replayed from its CUDA graph against the same step run eagerly."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel is built for compute capability 9.0 only")
    name, model, ads, reqs = family
    cpu, _ = generate(model, reqs, NEW, device="cpu", kv_cache_gb=0.05)  # the fp32 continuation
    kernels = KernelChoices(bf16_sm90=True, norm_early=True)
    eng = teacher.teacher_forced_check(model, ads, reqs, cpu, "bfloat16", f"{name} early norm", kernels=kernels,
                                       max_step_tokens=64)
    assert eng.model.norm_early and eng.model.own_norm is not None
    teacher.decode_graph_vs_eager(model, reqs, f"{name} early norm", kernels=kernels)


class CountingEpilogues:
    """The CUDA extension, counting the FP8 epilogue's launches that let the next kernel start at once (early)."""

    def __init__(self, ext):
        self.ext, self.early = ext, 0

    def __getattr__(self, name):
        return getattr(self.ext, name)

    def fp8_epilogue(self, *args, **kwargs):
        self.early += bool(kwargs.get("early"))
        return self.ext.fp8_epilogue(*args, **kwargs)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_family_early_epilogue(family, quantization):
    """KernelChoices.epilogue_early: the FP8 epilogue's launch (after FP8 products, and after the bf16 wgmma products
    with adapters) lets the next kernel start at once, which must wait for it before it reads its output; with
    KernelChoices.rope_kv_pdl the K/V writer after qkv's epilogue is that kernel too (launched with programmatic
    dependent launch, its blocks waiting first). A decode step with adapters, eager, bit for bit the same step without
    either on the same engine; then a decode step replayed from its CUDA graph against the same step run eagerly."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernels are built for compute capability 9.0 only")
    name, model, ads, reqs = family
    cfg = {"quantization": quantization} if quantization else {}
    kernels = KernelChoices(epilogue_early=True, rope_kv_pdl=True)
    eng, batch = teacher.decode_step(model, reqs, kernels=kernels, **cfg)
    d = eng.model
    try:
        assert d.epilogue_early
        fused = isinstance(d.kv_write, FusedKvWriter)  # (families with partial rotary take the torch writer)
        assert fused or name not in ("llama3", "gemma3"), name
        assert not fused or d.kv_write.launch == {"pdl": True}
        counted = CountingEpilogues(d.fp8_ext if quantization else d.sm90_ext)
        if quantization:
            d.fp8_ext = counted
        else:
            d.sm90_ext = counted
        dev = batch.to_device(eng.device)
        early = eng.runner.forward(batch, dev).clone()
        assert counted.early >= 2 * d.num_layers, counted.early  # (at least qkv's and gate_up's in every layer)
        d.epilogue_early = False
        if fused:
            d.kv_write.launch = {}
        assert torch.equal(eng.runner.forward(batch, dev), early), name
    finally:
        eng.close()
    teacher.decode_graph_vs_eager(model, reqs, f"{name} early epilogue {quantization or 'bf16'}", kernels=kernels,
                                  **cfg)


@pytest.fixture(scope="module")
def ungrouped(tmp_path_factory):
    """Llama with one query head per K/V head (the Llama-2 shape, where `auto` takes the project's decode kernel for
    e4m3 pages), its adapters and requests."""
    d = tmp_path_factory.mktemp("gpu-llama-mha")
    model = write_gpu_family_model("llama3", d / "model", num_key_value_heads=4)
    ads = {"all16": write_random_adapter(model, d / "all16", r=16, alpha=32, targets=family_targets("llama3"), seed=5)}
    g = torch.Generator().manual_seed(19)
    reqs = [(torch.randint(3, 4096, (int(torch.randint(20, 60, (1,), generator=g)),), generator=g).tolist(),
             "all16" if i % 2 else None, ads["all16"] if i % 2 else None) for i in range(8)]
    return model, reqs


def test_default_decode_kernel_for_e4m3_pages_without_grouped_heads(ungrouped):
    """LORAFLEET_DECODE_KERNEL=auto (the default) with FP8 K/V pages and one query head per K/V head: the project's
    kernel is taken, against flashinfer's decode on the same step and its graph replay against its eager step; with
    bf16 pages the default stays on flashinfer's."""
    model, reqs = ungrouped
    teacher.decode_kernel_vs_flashinfer(model, reqs, "llama MHA FP8 pages auto", kv_cache_dtype="fp8",
                                        kernels=KernelChoices())
    bf16, _ = teacher.decode_step(model, reqs)
    assert bf16.attention.own is None


@pytest.mark.parametrize("stages", [3, 5])
def test_staged_decode_kernel_gives_the_register_versions_logits(ungrouped, stages):
    """KernelChoices.decode_stages 3 (the default) and 5 (the K/V rows copied ahead through shared memory, a
    programmatic launch after rope_kv): a decode step's eager logits are bit for bit those of the kernel that loads one
    pass ahead into registers, and its graph replay (captured with the stages) agrees with them within the tolerance
    that the register version's replay is held to against its eager step."""
    model, reqs = ungrouped
    eng, batch = teacher.decode_step(model, reqs, kv_cache_dtype="fp8", kernels=KernelChoices(decode_stages=stages))
    own = eng.attention.own
    assert own is not None and own.stages == stages
    d = batch.to_device(eng.device)
    staged = eng.runner.forward(batch, d).clone()
    own.stages = 0
    try:
        registers = eng.runner.forward(batch, d).clone()
    finally:
        own.stages = stages
    assert torch.equal(staged, registers)
    replay = eng.runner.graphs.run(batch, d).clone()
    span = (staged.max(-1).values - staged.min(-1).values)[:, None]
    assert ((replay - staged).abs() / span).max().item() < teacher.TOL
    assert (replay.argmax(-1) == staged.argmax(-1)).float().mean().item() >= 0.9


def test_integer_conversion_and_short_chunks_in_the_engine(ungrouped):
    """KernelChoices.decode_int_convert (e4m3 bytes to fp32 by integer ops): a decode step's eager logits bit for bit
    those of the cvt instructions; decode_chunk 64 with 16 CTAs per SM (more workers per request): logits within the
    replay tolerance of the default chunk's (the chunks' merge order differs), and its graph replay agrees with them."""
    model, reqs = ungrouped
    eng, batch = teacher.decode_step(model, reqs, kv_cache_dtype="fp8",
                                     kernels=KernelChoices(decode_int_convert=True))
    own = eng.attention.own
    assert own is not None and own.int_convert and own.stages == 3
    d = batch.to_device(eng.device)
    ic = eng.runner.forward(batch, d).clone()
    own.int_convert = False
    try:
        cvt = eng.runner.forward(batch, d).clone()
    finally:
        own.int_convert = True
    assert torch.equal(ic, cvt)
    eng2, batch2 = teacher.decode_step(model, reqs, kv_cache_dtype="fp8",
                                       kernels=KernelChoices(decode_chunk=64, decode_ctas_per_sm=16))
    assert eng2.attention.own.chunk == 64 and eng2.attention.own.ctas_per_sm == 16
    d2 = batch2.to_device(eng2.device)
    short = eng2.runner.forward(batch2, d2).clone()
    span = (cvt.max(-1).values - cvt.min(-1).values)[:, None]
    assert ((short - cvt).abs() / span).max().item() < teacher.TOL
    replay = eng2.runner.graphs.run(batch2, d2).clone()
    assert ((replay - short).abs() / span).max().item() < teacher.TOL
