"""FP8 weights and KV pages on the CPU: the FP8 path equals an fp32 model whose projection weights were rounded
through e4m3 with one scale per output row (checked against HF transformers + PEFT on such a model); the
pre-quantized checkpoint formats load (compressed-tensors per channel and per tensor, transformers' fine-grained
128 x 128 blocks); unsupported schemes are refused by name; tensor parallelism rounds as one rank does."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from family_models import family_targets, write_family_model
from fp8_reference import block_quantize, emulate_fp8, is_proj, rounded_copy
from lorafleet.runner.config import EngineConfig
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence
from lorafleet.runner.model.fp8 import E4M3, from_checkpoint, quantize_rows
from lorafleet.runner.model.weights import WeightsError
from model_helpers import write_random_adapter
from reference import HFReference

NEW = 10


def requests(ads, n=8):
    g = torch.Generator().manual_seed(5)
    names = [None] + sorted(ads)
    return [Sequence(f"r{i}", torch.randint(3, 256, (int(torch.randint(6, 30, (1,), generator=g)),), generator=g).tolist(),
                     SamplingParams(max_tokens=NEW, ignore_eos=True),
                     AdapterRef(names[i % len(names)], str(ads[names[i % len(names)]])) if names[i % len(names)] else None,
                     arrival=float(i)) for i in range(n)]


def generate(model, ads, **cfg):
    eng = Engine(str(model), EngineConfig(**{"device": "cpu", "max_batch_size": 8, "page_size": 4, "num_pages": 400,
                                             "max_lora_rank": 16, **cfg}))
    try:
        return {k: v.output_ids for k, v in eng.run_to_completion(requests(ads)).items()}, eng
    finally:
        eng.close()


@pytest.fixture(scope="module", params=["llama3", "phi3"])
def fam(request, tmp_path_factory):
    """A family with separate q/k/v (llama3) and one with fused qkv and gate_up (phi3), two adapters each."""
    name = request.param
    d = tmp_path_factory.mktemp(f"fp8-{name}")
    model = write_family_model(name, d / "model", seed=4)
    ads = {"all": write_random_adapter(model, d / "all", r=8, alpha=16, targets=family_targets(name), seed=6),
           "mlp": write_random_adapter(model, d / "mlp", r=4, alpha=8, targets=family_targets(name, "mlp"), seed=7)}
    return name, model, ads, d


def test_fp8_weights_equal_an_fp32_model_rounded_through_e4m3(fam):
    name, model, ads, d = fam
    got, eng = generate(model, ads, quantization="fp8")
    from lorafleet.runner.model.fp8 import Fp8Weight

    assert isinstance(eng.model.layers[0].qkv, Fp8Weight) and eng.model.layers[0].qkv.q.dtype == E4M3
    assert eng.model.embed.dtype == torch.float32 and not isinstance(eng.model.lm_head, Fp8Weight)  # stay as they are
    ref_dir = d / "rounded" if (d / "rounded").exists() else rounded_copy(model, d / "rounded")
    ref = HFReference(ref_dir, ads)
    for s in requests(ads):
        assert got[s.id] == ref.greedy(s.prompt_ids, s.adapter.name if s.adapter else None, NEW, eos=None), (name, s.id)
    plain, _ = generate(model, ads)
    assert plain != got  # the rounding is visible: the test would see a path that skipped it


def test_fp8_with_tensor_parallelism_rounds_as_one_rank(fam):
    """Row-parallel projections (o, down) keep the scales of whole rows on every rank."""
    _, model, ads, _ = fam
    one, _ = generate(model, ads, quantization="fp8", lora_slots=2)
    two, _ = generate(model, ads, quantization="fp8", lora_slots=2, tp=2)
    assert one == two


def test_fp8_kv_pages_equal_hf_with_k_and_v_rounded_through_e4m3(fam):
    """FP8 K/V pages on an fp32 CPU model: a quarter of the bytes per page, and the tokens of HF + PEFT whose
    attention sees K (after RoPE) and V rounded through e4m3 at scale 1 (fp8_reference.emulate_fp8)."""
    name, model, ads, _ = fam
    fp32, e32 = generate(model, ads, kv_cache_gb=0.01, num_pages=None)
    fp8, e8 = generate(model, ads, kv_cache_gb=0.01, num_pages=None, kv_cache_dtype="fp8")
    assert e8.kv.k.dtype == E4M3 and e8.blocks.num_pages >= 4 * e32.blocks.num_pages - 4
    ref = HFReference(model, ads)
    with emulate_fp8(ref.peft, activations=False, kv=True):
        for s in requests(ads):
            assert fp8[s.id] == ref.greedy(s.prompt_ids, s.adapter.name if s.adapter else None, NEW), (name, s.id)
    assert fp8 != fp32  # the rounding is visible


# --- pre-quantized checkpoints -----------------------------------------------------------------------------


def quantized_copy(model, out, fmt: str):
    """The HF directory as a pre-quantized FP8 checkpoint of `fmt`: compressed-tensors channel / tensor, or
    transformers' fine-grained fp8 with 128 x 128 block scales (`weight_scale_inv`); returns the weights its
    scales stand for (dequantized), per projection tensor."""
    out.mkdir()
    sd = load_file(str(model / "model.safetensors"))
    cfg = json.loads((model / "config.json").read_text())
    new, exact = {}, {}
    for k, v in sd.items():
        if not is_proj(k):
            new[k] = v
            continue
        w = v.float()
        if fmt == "channel":
            s = (w.abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
            new[k], new[k + "_scale"] = (w / s).clamp(-448, 448).to(E4M3), s
            exact[k] = new[k].float() * s
        elif fmt == "tensor":
            s = (w.abs().amax() / 448).reshape(1)
            new[k], new[k + "_scale"] = (w / s).clamp(-448, 448).to(E4M3), s
            exact[k] = new[k].float() * s
        else:  # 128 x 128 blocks (these small weights: one or two blocks per dimension)
            br = bc = 128
            new[k], s = block_quantize(w, br, bc)
            new[k + "_scale_inv"] = s
            exact[k] = from_checkpoint(new[k], s, "block", (br, bc)).dequant()
    save_file({k: v.contiguous() for k, v in new.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    if fmt == "block":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    else:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "strategy": fmt, "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
    (out / "config.json").write_text(json.dumps(cfg))
    return out, exact


@pytest.mark.parametrize("fmt", ["channel", "tensor", "block"])
def test_pre_quantized_checkpoints_load_as_their_scales_say(fam, fmt, tmp_path):
    """The engine's FP8 weights stand for exactly what the checkpoint's scales say (blocks: re-rounded to
    per-row scales, within e4m3's rounding of the block values), and generation matches HF + PEFT on an
    fp32 model with those weights."""
    name, model, ads, _ = fam
    qdir, exact = quantized_copy(model, tmp_path / "q", fmt)
    got, eng = generate(qdir, ads)  # no --quantization: the checkpoint says FP8
    from lorafleet.runner.model.fp8 import Fp8Weight

    lw = eng.model.layers[0]
    assert isinstance(lw.down, Fp8Weight)
    down = exact["model.layers.0.mlp.down_proj.weight"]
    if fmt == "block":
        torch.testing.assert_close(lw.down.dequant(), down, rtol=0.07, atol=0)  # one more e4m3 rounding at most
    else:
        assert torch.equal(lw.down.dequant(), down)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    sd = load_file(str(model / "model.safetensors"))
    engine_view = {k: (v if k not in exact else (from_checkpoint(*_q_s(qdir, k), fmt, (128, 128)).dequant()
                                                   if fmt == "block" else exact[k])) for k, v in sd.items()}
    save_file({k: v.contiguous() for k, v in engine_view.items()}, str(ref_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (ref_dir / "config.json").write_text((model / "config.json").read_text())
    ref = HFReference(ref_dir, ads)
    for s in requests(ads):
        assert got[s.id] == ref.greedy(s.prompt_ids, s.adapter.name if s.adapter else None, NEW, eos=None), (name, fmt, s.id)


def _q_s(qdir, k):
    sd = load_file(str(qdir / "model.safetensors"))
    return sd[k], sd[k + "_scale_inv"]


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "gptq", "bits": 4}, "quantization method 'gptq' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static' are not supported"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {}},
     "format 'int-quantized' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}, "weights of type 'int' with 4 bits"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}},
     "input activations .* are not supported"),
])
def test_unsupported_quantization_is_refused_by_name(fam, qc, words, tmp_path):
    _, model, _, _ = fam
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").symlink_to(model / "model.safetensors")
    cfg = json.loads((model / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(WeightsError, match=words):
        Engine(str(tmp_path / "m"), EngineConfig(device="cpu", num_pages=50))


def test_quantize_rows_semantics():
    w = torch.randn(7, 33) * torch.linspace(0.01, 5, 7)[:, None]
    w[3] = 0  # an all-zero row keeps a usable scale
    q = quantize_rows(w)
    assert q.q.dtype == E4M3 and q.scale.shape == (7,)
    assert torch.equal(q.scale[[0, 6]], (w.abs().amax(1) / 448)[[0, 6]])
    assert q.q.float().abs().amax(1)[[0, 6]].tolist() == [448.0, 448.0]  # each row's largest value at the top
    assert torch.equal(q.dequant()[3], torch.zeros(33))
    err = (q.dequant() - w).abs() / w.abs().amax(1, keepdim=True).clamp(min=1e-6)
    assert err.max() <= 1 / 16  # e4m3: 3 mantissa bits
