"""`lorafleet bench quality`: the logits it scores are HF + PEFT's (base and adapter, every position), its
perplexity is the one HF's logits give over the same windows, and the FP8 rows compare against the first."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lorafleet.bench import quality
from lorafleet.scheduler.tokenizer import Tokenizer
from model_helpers import write_random_adapter
from reference import HFReference

TEXT = ("We hold these truths to be self-evident, that all men are created equal, that they are endowed by their "
        "Creator with certain unalienable Rights, that among these are Life, Liberty and the pursuit of Happiness.")
WINDOW = 16


@pytest.fixture(scope="module")
def setup(tiny_chat_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("quality")
    ad = write_random_adapter(tiny_chat_llama, d / "ad", r=8, alpha=16,
                              targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                              seed=3)
    return tiny_chat_llama, {"ad": ad}


def hf_nll(ref: HFReference, ids: list[int], adapter: str | None) -> tuple[float, int]:
    """The same windows as the bench, scored by HF (+ PEFT) in fp32."""
    nll, n = 0.0, 0
    for start in range(0, len(ids) - 1, WINDOW):
        chunk = ids[start: start + WINDOW + 1]
        if len(chunk) < 2:
            break
        logits = ref.logits(chunk[:-1], adapter)
        nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="sum"))
        n += len(chunk) - 1
    return nll, n


def test_quality_bench_scores_hf_logits_and_compares_fp8(setup, tmp_path):
    model, ads = setup
    ids = Tokenizer(str(model)).encode(TEXT)
    assert len(ids) > 2 * WINDOW  # several windows, the last one short
    res = quality.run(str(model), TEXT, ads, "cpu", WINDOW, ["model", "fp8"], lambda m: None)
    ref = HFReference(model, ads)
    first = res["precisions"]["model"]["by_model"]
    for label, adapter in (("base", None), ("ad", "ad")):
        nll, n = hf_nll(ref, ids, adapter)
        assert first[label]["positions"] == n == len(ids) - 1
        assert first[label]["ppl"] == pytest.approx(math.exp(nll / n), rel=1e-3)
    assert first["base"]["ppl"] != pytest.approx(first["ad"]["ppl"], rel=1e-3)  # the adapter was applied
    fp8 = res["summary"]["fp8"]
    assert res["precisions"]["fp8"]["dtype"] == "float32"
    assert fp8["positions"] == 2 * (len(ids) - 1)
    assert 0.5 <= fp8["top1_agreement"] <= 1.0
    for label in ("base", "ad"):
        assert fp8["ppl_ratio"][label] == pytest.approx(res["precisions"]["fp8"]["by_model"][label]["ppl"]
                                                        / first[label]["ppl"], rel=1e-3)
        assert fp8["ppl_ratio"][label] != 1.0  # e4m3 rounding moved something


def test_window_logits_equal_hf_at_every_position(setup):
    from lorafleet.runner.config import EngineConfig
    from lorafleet.runner.engine.engine import Engine
    from lorafleet.runner.engine.sequence import AdapterRef

    model, ads = setup
    ids = Tokenizer(str(model)).encode(TEXT)[:30]
    ref = HFReference(model, ads)
    eng = Engine(str(model), EngineConfig(device="cpu", max_batch_size=4, max_lora_rank=16, page_size=4,
                                          num_pages=64))
    try:
        free = eng.blocks.free_pages
        for adapter in (None, "ad"):
            got = quality.window_logits(eng, ids, AdapterRef("ad", str(ads["ad"])) if adapter else None)
            assert got.shape == (len(ids), ref.logits(ids, adapter).shape[-1])
            torch.testing.assert_close(got, ref.logits(ids, adapter), rtol=1e-4, atol=1e-4)
        assert eng.blocks.free_pages == free  # pages given back
    finally:
        eng.close()


def test_cli_writes_json_and_table(setup, tmp_path, capsys):
    model, ads = setup
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    adir = ads["ad"].parent
    out = tmp_path / "q.json"
    assert quality.main(["--model", str(model), "--adapters", str(adir), "--text", str(text), "--device", "cpu",
                         "--window", str(WINDOW), "--precisions", "model", "fp8", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["precisions"]) == {"model", "fp8"} and set(res["precisions"]["model"]["by_model"]) == {"base", "ad"}
    assert res["card"] == "cpu"
    table = capsys.readouterr().out
    assert "| fp8 (float32) |" in table and str(res["summary"]["fp8"]["top1_agreement"]) in table
