"""Bad adapters fail their own requests with a clear error; everything else still runs."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_helpers import write_random_adapter, write_random_llama
from lorafleet.common.peft_config import AdapterError, inspect_adapter
from lorafleet.runner.config import EngineConfig
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence


@pytest.fixture(scope="module")
def good(tiny_llama, tmp_path_factory):
    return write_random_adapter(tiny_llama, tmp_path_factory.mktemp("good") / "good", r=8,
                                targets=("q_proj", "v_proj", "gate_proj"), seed=1)


def variant(good, tmp_path, name, *, config=None, tensors=None, drop=(), raw_weights=None):
    d = tmp_path / name
    shutil.copytree(good, d)
    if config is not None:
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg.update(config)
        (d / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        w = load_file(str(d / "adapter_model.safetensors"))
        w = tensors(w)
        save_file(w, str(d / "adapter_model.safetensors"))
    if raw_weights is not None:
        (d / "adapter_model.safetensors").write_bytes(raw_weights)
    for f in drop:
        (d / f).unlink()
    return d


def raw_safetensors(header: dict, data_len: int) -> bytes:
    """A safetensors file with this header as it is (JSON-encoded, unchecked) and `data_len` zero bytes of data."""
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(data_len)


def make_bad(good, tiny_llama, tmp_path):
    first_a = lambda w: next(k for k in w if "lora_A" in k)  # noqa: E731
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    other = write_random_llama(tmp_path / "other-base", hidden=96, heads=4, kv_heads=4, inter=256)
    bads = {
        "dora": (variant(good, tmp_path, "dora", config={"use_dora": True}), "DoRA"),
        "saves": (variant(good, tmp_path, "saves", config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
        "embed": (variant(good, tmp_path, "embed", tensors=lambda w: {
            **w, "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 512)}), "embedding"),
        "head": (variant(good, tmp_path, "head", tensors=lambda w: {
            **w, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 128),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(512, 8)}), "lm_head"),
        "othermodel": (write_random_adapter(other, tmp_path / "othermodel", r=4, targets=("q_proj",)), "do not fit"),
        "noconfig": (variant(good, tmp_path, "noconfig", drop=["adapter_config.json"]), "adapter_config.json not found"),
        "badjson": (variant(good, tmp_path, "badjson"), "not valid JSON"),
        "noweights": (variant(good, tmp_path, "noweights", drop=["adapter_model.safetensors"]), "not found"),
        "truncated": (variant(good, tmp_path, "truncated",
                              raw_weights=(good / "adapter_model.safetensors").read_bytes()[:200]), "corrupt"),
        "pickle": (variant(good, tmp_path, "pickle", drop=["adapter_model.safetensors"]), "never unpickled"),
        "rank": (write_random_adapter(tiny_llama, tmp_path / "rank", r=64, targets=("q_proj",)), "exceeds"),
        "nan": (variant(good, tmp_path, "nan", tensors=lambda w: {
            k: (v * float("nan") if k == first_a(w) else v) for k, v in w.items()}), "NaN"),
        "missing": (tmp_path / "does-not-exist", "does not exist"),
        "notlora": (variant(good, tmp_path, "notlora", config={"peft_type": "IA3"}), "IA3"),
        "bias": (variant(good, tmp_path, "bias", config={"bias": "all"}), "bias"),
        # PEFT kinds that plain LoRA would serve wrongly (aLoRA acts only after its invocation tokens)
        "alora": (variant(good, tmp_path, "alora", config={"alora_invocation_tokens": [5, 6]}), "activated LoRA"),
        "qalora": (variant(good, tmp_path, "qalora", config={"use_qalora": True}), "QALoRA"),
        "patternlist": (variant(good, tmp_path, "patternlist", config={"rank_pattern": ["v_proj"]}),
                        "rank_pattern must map module names"),
        "patternregex": (variant(good, tmp_path, "patternregex", config={"alpha_pattern": {"v_proj(": 4}}),
                         "alpha_pattern key 'v_proj(' is not a valid regular expression"),
        "patternflags": (variant(good, tmp_path, "patternflags", config={"rank_pattern": {"(?i)v_proj": 8}}),
                         "rank_pattern key '(?i)v_proj' is not a valid regular expression"),
        # weights PEFT would not load as they are: a rank other than the config's, a module the config leaves out
        "rankcfg": (variant(good, tmp_path, "rankcfg", config={"r": 4}), "rank 8 but adapter_config.json gives r = 4"),
        "rankpattern": (variant(good, tmp_path, "rankpattern", config={"rank_pattern": {"v_proj": 16}}),
                        "rank_pattern = 16"),
        "untargeted": (variant(good, tmp_path, "untargeted", config={"target_modules": ["q_proj", "gate_proj"]}),
                       "leave out"),
        "excluded": (variant(good, tmp_path, "excluded", config={"exclude_modules": ["gate_proj"]}), "leave out"),
        "layers": (variant(good, tmp_path, "layers", config={"layers_to_transform": [0]}), "leave out"),
        # a module the config targets without weights (PEFT: missing keys, lora_B = 0): nowhere, or in one layer
        "noq": (variant(good, tmp_path, "noq", tensors=lambda w: {k: v for k, v in w.items() if "q_proj" not in k}),
                "adapter_config.json targets q_proj but adapter_model.safetensors holds no LoRA weights for it"),
        # a scale that is not a number, or one whose add-on would swamp or overflow the layer's output
        "alphanan": (variant(good, tmp_path, "alphanan", config={"lora_alpha": float("nan")}),
                     "lora_alpha must be a finite number, got nan"),
        "alphainf": (variant(good, tmp_path, "alphainf", config={"alpha_pattern": {"v_proj": float("inf")}}),
                     "lora_alpha must be a finite number, got inf (for model.layers.0.self_attn.v_proj)"),
        "alphahuge": (variant(good, tmp_path, "alphahuge", config={"lora_alpha": -1e30}),
                      "scales model.layers.0.self_attn.q_proj's add-on by -1.25e+29, beyond the 10000 served"),
        # the weights' name taken by something that is not a file (never opened: a pipe would block its reader)
        "fifo": (variant(good, tmp_path, "fifo", drop=["adapter_model.safetensors"]),
                 "adapter_model.safetensors is not a regular file"),
        "weightsdir": (variant(good, tmp_path, "weightsdir", drop=["adapter_model.safetensors"]),
                       "adapter_model.safetensors is not a regular file"),
        "gap": (variant(good, tmp_path, "gap", tensors=lambda w: {k: v for k, v in w.items()
                                                               if ".layers.1.self_attn.v_proj." not in k}),
                "layer 1 v_proj: adapter_model.safetensors has no "
                "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"),
        # safetensors headers of the wrong JSON types (once a TypeError past the checks), of a negative shape that
        # matches the byte count, nested past the JSON parser's stack (once a RecursionError)
        "hdrtypes": (variant(good, tmp_path, "hdrtypes", raw_weights=raw_safetensors(
            {q_a: {"dtype": "F32", "shape": [8, 128], "data_offsets": ["0", "4096"]}}, 4096)), "malformed entry"),
        "hdrdtype": (variant(good, tmp_path, "hdrdtype", raw_weights=raw_safetensors(
            {q_a: {"dtype": ["F32"], "shape": [8, 128], "data_offsets": [0, 4096]}}, 4096)), "malformed entry"),
        "hdrneg": (variant(good, tmp_path, "hdrneg", raw_weights=raw_safetensors(
            {q_a: {"dtype": "F32", "shape": [-8, -128], "data_offsets": [0, 4096]}}, 4096)), "malformed entry"),
        "hdrdeep": (variant(good, tmp_path, "hdrdeep", raw_weights=struct.pack("<Q", 200_000) + b"[" * 100_000
                            + b"]" * 100_000), "corrupt header"),
        # the config's own file: not a file (a pipe would block its reader), or too large to read whole
        "cfgdir": (variant(good, tmp_path, "cfgdir", drop=["adapter_config.json"]),
                   "adapter_config.json is not a regular file"),
        "cfghuge": (variant(good, tmp_path, "cfghuge"), "adapter_config.json is larger than the 16777216 bytes"),
        "alphastr": (variant(good, tmp_path, "alphastr", config={"lora_alpha": "16"}),
                     "lora_alpha must be a number, got '16'"),
        "layersstr": (variant(good, tmp_path, "layersstr", config={"layers_to_transform": "0"}),
                      "layers_to_transform must be a layer number or a list of them, got '0'"),
        # PEFT numbers layers after layers_pattern: [0] leaves out the file's layer 1 (once served all the same)
        "layerspattern": (variant(good, tmp_path, "layerspattern", config={"layers_to_transform": [0],
                                                                           "layers_pattern": "layers"}),
                          "holds LoRA weights for model.layers.1.self_attn.q_proj, which the config's"),
        # trained against base weights PEFT rewrites when it loads them: other outputs on the shared base
        "pissa": (variant(good, tmp_path, "pissa", config={"init_lora_weights": "pissa_niter_4"}),
                  "init_lora_weights='pissa_niter_4' is not supported: PEFT rewrites the base model's weights"),
        "olora": (variant(good, tmp_path, "olora", config={"init_lora_weights": "olora"}), "PEFT rewrites"),
        # LoRA variants PEFT turns on by the sub-config's presence, an empty one too
        "kasa": (variant(good, tmp_path, "kasa", config={"kasa_config": {}}), "kasa_config is not supported"),
        "arrow": (variant(good, tmp_path, "arrow", config={"arrow_config": {"top_k": 2}}),
                  "arrow_config is not supported"),
    }
    (bads["cfgdir"][0] / "adapter_config.json").mkdir()
    os.truncate(bads["cfghuge"][0] / "adapter_config.json", 1 << 40)  # sparse: a terabyte that takes no disk
    (bads["badjson"][0] / "adapter_config.json").write_text("{not json")
    (bads["pickle"][0] / "adapter_model.bin").write_bytes(b"\x80\x04pickle-payload-never-loaded")
    os.mkfifo(bads["fifo"][0] / "adapter_model.safetensors")
    (bads["weightsdir"][0] / "adapter_model.safetensors").mkdir()
    return bads


def test_every_refusal_is_clear_and_isolated(tiny_llama, good, tmp_path):
    bads = make_bad(good, tiny_llama, tmp_path)
    eng = Engine(str(tiny_llama), EngineConfig(page_size=4, num_pages=400, max_batch_size=32, max_lora_rank=32))
    seqs = []
    for i, (name, (path, _)) in enumerate(bads.items()):
        seqs.append(Sequence(f"bad-{name}", [5, 6, 7, 8], SamplingParams(max_tokens=4), AdapterRef(name, str(path))))
        seqs.append(Sequence(f"ok-{i}", [9, 10, 11 + i], SamplingParams(max_tokens=6, ignore_eos=True),
                             AdapterRef("good", str(good)) if i % 2 else None))
    out = eng.run_to_completion(seqs)
    for name, (_, phrase) in bads.items():
        o = out[f"bad-{name}"]
        assert o.finish_reason == "error", (name, o)
        assert f"adapter {name!r}" in o.error and phrase in o.error, (name, o.error)
    for s in seqs:
        if s.id.startswith("ok-"):
            assert out[s.id].finish_reason == "length" and len(out[s.id].output_ids) == 6
    assert eng.blocks.free_pages == eng.blocks.num_pages


def test_config_forms_peft_accepts_still_load(good, tiny_llama, tmp_path):
    """target_modules as a regex or all-linear, and a rank_pattern that agrees with the tensors, are what PEFT
    itself loads: accepted."""
    for name, cfg in (("regex", {"target_modules": r".*\.(q_proj|v_proj|gate_proj)"}),
                      ("pattern", {"r": 4, "rank_pattern": {"q_proj": 8, "v_proj": 8, "gate_proj": 8}})):
        spec = inspect_adapter(name, variant(good, tmp_path, name, config=cfg))
        assert spec.max_rank == 8 and spec.target_modules == ("q", "v", "gate"), name
    # all-linear is every projection (what PEFT saves for it); over three of seven, four are missing
    every = write_random_adapter(tiny_llama, tmp_path / "every", r=4, targets=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                              "gate_proj", "up_proj", "down_proj"))
    spec = inspect_adapter("alllinear", variant(every, tmp_path, "alllinear", config={"target_modules": "all-linear"}))
    assert spec.target_modules == ("q", "k", "v", "o", "gate", "up", "down")
    with pytest.raises(AdapterError, match="targets k_proj, o_proj, up_proj, down_proj but .* no LoRA weights for"):
        inspect_adapter("partial", variant(good, tmp_path, "partial", config={"target_modules": "all-linear"}))


def test_modules_some_layers_leave_out_by_config_still_load(tiny_llama, tmp_path):
    """Weights PEFT saves with a module in some layers only — layers_to_transform, exclude_modules, a regex that
    names layers — are complete: accepted, with exactly the modules the file holds."""
    cases = {
        "layers": dict(targets=("q_proj", "v_proj"), layers_to_transform=[1]),
        "exclude": dict(targets=("q_proj", "v_proj"), exclude_modules=["model.layers.0.self_attn.q_proj"]),
        "regex": dict(targets=r"model\.layers\.1\.self_attn\.q_proj|.*\.v_proj"),
        # PEFT's layers_to_transform as PEFT reads it: numbered after layers_pattern; not applied to a module
        # target_modules names in full; an empty list is every layer (the last two were once refused)
        "pattern": dict(targets=("q_proj", "v_proj"), layers_to_transform=[1], layers_pattern=["h", "layers"]),
        "fullname": dict(targets=("model.layers.1.self_attn.q_proj", "v_proj"), layers_to_transform=[0]),
        "nolayers": dict(targets=("q_proj",), layers_to_transform=[]),
    }
    want = {"layers": {(1, "q"), (1, "v")}, "exclude": {(0, "v"), (1, "q"), (1, "v")},
            "regex": {(0, "v"), (1, "q"), (1, "v")}, "pattern": {(1, "q"), (1, "v")},
            "fullname": {(1, "q"), (0, "v")}, "nolayers": {(0, "q"), (1, "q")}}
    for name, kw in cases.items():
        targets = kw.pop("targets")
        path = write_random_adapter(tiny_llama, tmp_path / name, r=4, targets=targets, **kw)
        spec = inspect_adapter(name, path)
        assert {(m.layer, m.proj) for m in spec.modules} == want[name], name


def test_shouty_without_q_proj_is_refused_naming_the_module(demo_model, demo_adapters, tmp_path):
    """The demo's shouty adapter (q, k, v, o) with every q_proj tensor taken out of its weights: refused against
    the demo base, naming q_proj; the file as shipped loads."""
    from lorafleet.models import registry

    base = registry.config_from_hf(json.loads((demo_model / "config.json").read_text())).base_shape()
    assert inspect_adapter("shouty", demo_adapters / "shouty", base=base).target_modules == ("q", "k", "v", "o")
    broken = variant(demo_adapters / "shouty", tmp_path, "shouty",
                     tensors=lambda w: {k: v for k, v in w.items() if "q_proj" not in k})
    with pytest.raises(AdapterError, match=r"^adapter 'shouty': adapter_config.json targets q_proj but "
                                           r"adapter_model.safetensors holds no LoRA weights for it in any layer"):
        inspect_adapter("shouty", broken, base=base)


def test_inspect_reports_ranks_targets_and_scaling(good):
    spec = inspect_adapter("good", good)
    assert spec.max_rank == 8 and spec.target_modules == ("q", "v", "gate")
    assert {m.scaling for m in spec.modules} == {2.0}
    with pytest.raises(AdapterError, match="exceeds"):
        inspect_adapter("good", good, max_rank=4)


def test_an_adapter_that_overflows_stops_its_request_and_no_other(tiny_llama, good, tmp_path):
    """Finite weights that overflow in the product (a lora_A row of 3e38, which every load-time check passes) make
    NaN logits and NaN K/V pages. The request is stopped with an error naming its adapter (its tokens were the argmax
    of NaN rows); the requests beside it in the same steps keep the tokens they get alone
    (tests/test_torch_attention_padding.py: the padding that once carried NaN pages to other rows)."""
    def poison(w):
        k = next(k for k in w if "v_proj.lora_A" in k)
        w = {n: t.float() for n, t in w.items()}
        w[k][0, :] = 3e38  # x . a overflows to +-inf, and inf - inf is NaN
        return w

    bad = variant(good, tmp_path, "overflow", tensors=poison)
    prompts = [[9, 10, 11, 12, 13, 14, 15], [21, 22], [30, 31, 32, 33]]  # shorter and longer than the bad one

    def run(with_bad: bool):
        eng = Engine(str(tiny_llama), EngineConfig(page_size=4, num_pages=400, max_batch_size=8, max_lora_rank=32))
        seqs = [Sequence(f"ok-{i}", p, SamplingParams(max_tokens=8, ignore_eos=True),
                         AdapterRef("good", str(good)) if i == 2 else None) for i, p in enumerate(prompts)]
        if with_bad:
            seqs.insert(1, Sequence("bad", [5, 6, 7, 8, 9], SamplingParams(max_tokens=8, ignore_eos=True),
                                    AdapterRef("overflow", str(bad))))
        out = eng.run_to_completion(seqs)
        assert eng.blocks.free_pages == eng.blocks.num_pages
        return out

    alone, shared = run(False), run(True)
    o = shared["bad"]
    assert o.finish_reason == "error" and "not finite" in o.error and "adapter 'overflow'" in o.error, o
    assert not o.output_ids  # its very first token's logits are NaN: nothing is reported as a token
    for i in range(len(prompts)):
        assert shared[f"ok-{i}"].output_ids == alone[f"ok-{i}"].output_ids, i
        assert shared[f"ok-{i}"].finish_reason == "length"
