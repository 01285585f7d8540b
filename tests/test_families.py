"""Every supported family, built by transformers' own classes with random weights, runs token-identical to
HF transformers + PEFT (greedy, fp32, CPU) in one mixed batch of several adapters and the base model, with
prompts longer than the family's sliding window; tensor parallelism over 2 ranks (gloo) gives the tokens of
one rank."""

from __future__ import annotations

import pytest
import torch

from family_models import FAMILIES, WINDOW, family_targets, write_family_model
from lorafleet.runner.config import EngineConfig
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence
from model_helpers import write_random_adapter
from reference import HFReference

pytestmark = pytest.mark.timeout(600)
NEW = 12


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, model dir, adapters): a random model of the family and three PEFT adapters of different ranks,
    targets and scalings."""
    name = request.param
    d = tmp_path_factory.mktemp(name)
    model = write_family_model(name, d / "model", seed=3)
    ads = {
        "all8": write_random_adapter(model, d / "all8", r=8, alpha=16, targets=family_targets(name), seed=5),
        "attn4": write_random_adapter(model, d / "attn4", r=4, alpha=8, targets=family_targets(name, "attn"), seed=6,
                                      use_rslora=True),
        "mlp16": write_random_adapter(model, d / "mlp16", r=16, alpha=8, targets=family_targets(name, "mlp"), seed=7),
    }
    return name, model, ads


def requests(ads, n=10, new=NEW):
    """Prompts of 12 to 40 tokens (longer than the window) over the three adapters and the base model."""
    g = torch.Generator().manual_seed(13)
    names = [None, "all8", "attn4", "mlp16"]
    out = []
    for i in range(n):
        ids = torch.randint(3, 256, (int(torch.randint(WINDOW + 4, 40, (1,), generator=g)),), generator=g).tolist()
        name = names[i % 4]
        out.append(Sequence(f"r{i}", ids, SamplingParams(max_tokens=new, ignore_eos=True),
                            AdapterRef(name, str(ads[name])) if name else None, arrival=float(i)))
    return out


def generate(model, ads, n=10, new=NEW, **cfg):
    eng = Engine(str(model), EngineConfig(device="cpu", max_batch_size=8, page_size=4, num_pages=400,
                                          max_lora_rank=16, **cfg))
    try:
        done = eng.run_to_completion(requests(ads, n, new))
        assert eng.blocks.free_pages == eng.blocks.num_pages
    finally:
        eng.close()
    return {k: v.output_ids for k, v in done.items()}


def test_family_equals_hf_peft_in_one_mixed_batch(family):
    name, model, ads = family
    got = generate(model, ads, chunked_prefill=True, max_step_tokens=24)  # prompts split across steps
    ref = HFReference(model, ads)
    reqs = requests(ads)
    mismatches = []
    for s in reqs:
        want = ref.greedy(s.prompt_ids, s.adapter.name if s.adapter else None, NEW, eos=None)
        if got[s.id] != want:
            mismatches.append((s.id, s.adapter.name if s.adapter else None, got[s.id], want))
    assert not mismatches, mismatches
    # the adapters really change the output, per request
    base = generate(model, ads, enable_lora=False)
    assert sum(base[s.id] != got[s.id] for s in reqs if s.adapter) >= 5


def test_family_on_the_dense_lora_path_equals_hf_peft(family, monkeypatch):
    """LoRA's dense path forced onto the steps with prompt rows (work floor 1, any segment length), its qkv
    and gate_up as K-extended GEMMs where the family allows them (not behind Gemma's sandwich norms), counted; greedy
    tokens equal HF + PEFT's."""
    from lorafleet.runner.config import KernelChoices
    from lorafleet.runner.lora.step import LoraStepImpl

    name, model, ads = family
    kcalls = []
    real = LoraStepImpl._kext_linear
    monkeypatch.setattr(LoraStepImpl, "_kext_linear", staticmethod(lambda *a: kcalls.append(a[-2][1]) or real(*a)))
    got = generate(model, ads, chunked_prefill=True, max_step_tokens=64,
                   kernels=KernelChoices(dense_lora_rows=1, dense_lora_min_work=1, dense_lora_kext=16))
    assert (len(kcalls) > 0) == (name != "gemma3"), (name, len(kcalls))
    ref = HFReference(model, ads)
    bad = [(s.id, got[s.id]) for s in requests(ads)
           if got[s.id] != ref.greedy(s.prompt_ids, s.adapter.name if s.adapter else None, NEW, eos=None)]
    assert not bad, bad


def test_family_tp2_gives_the_tokens_of_one_rank(family):
    _, model, ads = family
    one = generate(model, ads, n=6, new=6, lora_slots=2)
    two = generate(model, ads, n=6, new=6, tp=2, lora_slots=2, overlap=True, chunked_prefill=True, max_step_tokens=16)
    assert two == one


# --- configs: what each family reads, and what it refuses -------------------------------------------------


def _cfg(family, **kw):
    import transformers

    cfg_name, model_name, fam_kw = FAMILIES[family]
    c = getattr(transformers, cfg_name)(**{**dict(vocab_size=64, hidden_size=64, intermediate_size=96,
                                                   num_hidden_layers=6, num_attention_heads=4), **fam_kw, **kw})
    return {**c.to_dict(), "architectures": [model_name]}


def test_released_qwen2_configs_keep_full_attention():
    """Qwen2.5's configs carry a sliding_window with use_sliding_window false: no layer is windowed."""
    from lorafleet.models.registry import config_from_hf, shapes

    assert config_from_hf(shapes()["qwen2.5-7b"]).layer_window == (None,) * 28
    on = config_from_hf(_cfg("qwen2", max_window_layers=4))  # use_sliding_window in the test family
    assert on.layer_window == (None,) * 4 + (WINDOW,) * 2


@pytest.mark.parametrize("params,scaling,top_theta", [
    ({"rope_type": "default", "rope_theta": 10000.0}, {"rope_type": "linear", "factor": 4.0}, None),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64, "rope_theta": 500000.0},
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}, None),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0}, {"rope_type": "linear", "factor": 2.0}, 30000.0),
])
def test_rope_given_twice_is_read_as_transformers_reads_it(params, scaling, top_theta):
    """rope_parameters beside rope_scaling: the engine read the first, transformers (4.x and 5) the second, with its
    own theta or else the top-level one, so the model ran silently with other positions than its reference."""
    import transformers

    from lorafleet.models.registry import config_from_hf

    cfg = {**_cfg("llama3"), "rope_parameters": params, "rope_scaling": scaling}
    cfg.pop("rope_theta", None)
    if top_theta is not None:
        cfg["rope_theta"] = top_theta
    hf = transformers.LlamaConfig.from_dict(cfg).rope_parameters
    ours = config_from_hf(cfg).ropes[0]
    assert ours.kind == hf["rope_type"] and ours.theta == hf["rope_theta"], (ours, hf)
    assert ours.factor == hf.get("factor", 1.0)


def test_longrope_caps_the_context_whatever_the_family():
    from lorafleet.models.registry import config_from_hf

    rs = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
          "original_max_position_embeddings": 256}
    cfg = {**_cfg("llama3"), "rope_scaling": rs, "rope_parameters": {**rs, "rope_theta": 10000.0},
           "max_position_embeddings": 4096}
    assert config_from_hf(cfg).max_position_embeddings == 256


def test_a_longrope_context_cap_is_logged_once_at_load(tmp_path, caplog):
    """Phi-3's LongRoPE caps the context at original_max_position_embeddings (64 here, of the config's 256): the
    engine says so in one INFO line at load, with the reason; a config within its original context logs none."""
    import logging

    from lorafleet.models.contract import ModelConfigError

    capped = write_family_model("phi3", tmp_path / "capped", layers=1)
    within = write_family_model("phi3", tmp_path / "within", layers=1, max_position_embeddings=64)
    caplog.set_level(logging.INFO, logger="lorafleet.runner.executor.executor")
    for model, n in ((capped, 1), (within, 0)):
        caplog.clear()
        eng = Engine(str(model), EngineConfig(device="cpu", num_pages=20, page_size=4))
        try:
            assert eng.model_config.max_position_embeddings == eng.max_model_len == 64
        finally:
            eng.close()
        lines = [r.getMessage() for r in caplog.records if "context capped" in r.getMessage()]
        assert len(lines) == n, lines
    caplog.clear()
    with pytest.raises(ModelConfigError, match="max_model_len 100 exceeds the model's context of 64 tokens"):
        Engine(str(capped), EngineConfig(device="cpu", num_pages=20, page_size=4, max_model_len=100))
    (line,) = [r for r in caplog.records if "context capped" in r.getMessage()]
    assert line.levelno == logging.INFO
    assert line.getMessage() == (
        "phi3: context capped at 64 tokens (LongRoPE runs with its short factors only: past "
        "original_max_position_embeddings 64 transformers switches every position of the sequence to the long "
        "factors, which K/V already written to the paged cache cannot follow); config max_position_embeddings 256")


def test_gemma_local_layers_keep_their_rope_without_a_window():
    """transformers picks a layer's RoPE by its type: local layers with a null window still take the local
    base (and attend to everything)."""
    from lorafleet.models.registry import config_from_hf

    c = config_from_hf({**_cfg("gemma3"), "sliding_window": None})
    assert c.layer_rope == (1, 0, 1, 0, 1, 0) and c.layer_window == (None,) * 6
    assert c.ropes[1].theta == 10000.0 and c.ropes[0].theta == 100000.0


@pytest.mark.parametrize("change, words", [
    (dict(architectures=["LlamaForSequenceClassification"]), "LlamaForSequenceClassification'] is not supported"),
    (dict(rope_scaling={"rope_type": "linear"}, rope_parameters={"rope_type": "linear", "rope_theta": 1e4}),
     "RoPE scaling 'linear': bad or missing parameter"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}, rope_parameters={"rope_type": "yarn", "factor": 2.0}),
     "RoPE scaling type 'yarn' is not supported"),
    (dict(eos_token_id="2"), "eos_token_id must be an integer"),
    (dict(hidden_act="relu"), "hidden_act 'relu' is not supported"),
])
def test_what_a_family_cannot_run_is_refused_by_name(change, words):
    from lorafleet.models.contract import ModelConfigError
    from lorafleet.models.registry import config_from_hf

    with pytest.raises(ModelConfigError, match=words.replace("(", r"\(").replace("[", r"\[")):
        config_from_hf({**_cfg("llama3"), **change})


def test_a_context_past_the_models_is_refused(family):
    from lorafleet.models.contract import ModelConfigError

    _, model, _ = family
    with pytest.raises(ModelConfigError, match="max_model_len 100000 exceeds the model's context of"):
        Engine(str(model), EngineConfig(device="cpu", num_pages=50, max_model_len=100000))


def test_family_with_shared_prefixes_equals_hf_peft(family):
    """Requests that share a prompt prefix longer than the window reuse its cached pages (two waves, the
    second finding the first's pages) and still produce HF + PEFT's tokens, for every family."""
    name, model, ads = family
    g = torch.Generator().manual_seed(29)
    system = torch.randint(3, 256, (22,), generator=g).tolist()
    names = [None, "all8", "attn4", "mlp16"]
    waves = [[Sequence(f"w{w}r{i}", system + torch.randint(3, 256, (3 + i,), generator=g).tolist(),
                       SamplingParams(max_tokens=6, ignore_eos=True),
                       AdapterRef(names[i], str(ads[names[i]])) if names[i] else None, arrival=float(4 * w + i))
              for i in range(4)] for w in range(2)]
    eng = Engine(str(model), EngineConfig(device="cpu", max_batch_size=8, page_size=4, num_pages=400,
                                          max_lora_rank=16, overlap=True, chunked_prefill=True, max_step_tokens=19))
    got = {}
    try:
        for wave in waves:
            got |= {k: v.output_ids for k, v in eng.run_to_completion(wave).items()}
    finally:
        eng.close()
    assert all(s.cached_tokens == 20 for s in waves[1])
    ref = HFReference(model, ads)
    for s in waves[0] + waves[1]:
        assert got[s.id] == ref.greedy(s.prompt_ids, s.adapter.name if s.adapter else None, 6, eos=None), (name, s.id)
