"""CPU checks of the end-to-end benchmark's building blocks (the benchmark itself needs a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lorafleet.common.peft_config import BaseShape
from lorafleet.bench.e2e import random_adapters, sharegpt_requests, write_peft_adapter
from lorafleet.runner.lora.adapter import load_adapter


def test_sharegpt_lengths_match_the_documented_means():
    reqs = sharegpt_requests(1000, 0, 32000)
    assert 235 <= np.mean([len(p) for p, _ in reqs]) <= 265
    assert 220 <= np.mean([o for _, o in reqs]) <= 250
    assert reqs == sharegpt_requests(1000, 0, 32000)  # seeded


def test_cold_start_files_load_back_to_the_same_weights(tmp_path):
    base = BaseShape(num_layers=2, hidden_size=64, intermediate_size=96, q_dim=64, kv_dim=32)
    (adapter,) = random_adapters(base, 1, 4, torch.float32, torch.device("cpu"), seed=1)
    write_peft_adapter(tmp_path / "a0", adapter, 4)
    back = load_adapter("a0", tmp_path / "a0", base, max_rank=8, dtype=torch.float32)
    assert set(back.weights) == set(adapter.weights)
    for key, (a, bt) in adapter.weights.items():
        assert torch.equal(back.weights[key][0], a) and torch.equal(back.weights[key][1], bt)


def _result(runs, requests=1000, card="GPU X", **extra):
    return {"card": card, "date": "2026-11-30", "max_batch": 32, "requests": requests,
            "runs": [{"label": k, "output_tok_s": v, "tpot_p99_ms": v / 100} for k, v in runs.items()], **extra}


def test_merged_summary_keeps_each_runs_lora_off_and_refuses_mismatches(tmp_path, capsys):
    import json

    import pytest

    from lorafleet.bench.e2e import main

    a = _result({"distinct": 100.0, "identical": 120.0, "lora off": 130.0},
                hf_peft_output_tok_s={"distinct": 3.0, "identical": 40.0, "sample": "x"})
    b = _result({"uniform": 110.0, "skewed": 115.0, "lora off": 128.0, "distinct": 99.0})
    c = _result({"uniform (cold start)": 90.0, "uniform (warm, same engine)": 100.0})
    a["floor_rates"] = {"bandwidth": 3.0e12, "matmul": 8.0e14, "measured": True, "source": "measured on X"}
    files = []
    for name, res in (("a", a), ("b", b), ("c", c)):
        (tmp_path / f"{name}.json").write_text(json.dumps(res))
        files.append(str(tmp_path / f"{name}.json"))
    out = tmp_path / "m.json"
    assert main(["--merge", *files, "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert merged["floor_rates"] == {files[0]: a["floor_rates"]}  # each part's floors at its own rates
    e2e = merged["e2e"]
    assert e2e["output_tok_s"] == {"distinct": 100.0, "uniform": 110.0, "skewed": 115.0, "identical": 120.0}
    assert e2e["lora_off_output_tok_s"] == 130.0
    assert [r["lora_off"] for r in e2e["lora_off_by_run"]] == [130.0, 128.0]
    assert e2e["hf_peft_output_tok_s"] == {"distinct": 3.0, "identical": 40.0}
    assert e2e["tpot_p99_ms"] == {"warm": 1.0, "cold": 0.9}
    (tmp_path / "d.json").write_text(json.dumps(_result({"distinct": 1.0}, requests=256)))
    with pytest.raises(SystemExit):
        main(["--merge", files[0], str(tmp_path / "d.json"), "--out", str(out)])
    assert "one requests" in capsys.readouterr().err
    png = tmp_path / "p.png"
    assert main(["--plot-from", files[0], files[1], "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_floor_model_counts_the_weights_transformers_counts(tiny_llama):
    """Weight bytes of the floor = lm_head + every layer's projections (norms and the embedding
    table are not read whole per step), checked against HF's own parameter count."""
    import json

    from transformers import AutoModelForCausalLM

    from lorafleet.bench.e2e import floor_model, floor_seconds
    from lorafleet.models.registry import config_from_hf

    cfg = config_from_hf(json.loads((tiny_llama / "config.json").read_text()))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    proj = sum(p.numel() for n, p in hf.named_parameters() if "proj" in n)
    fm = floor_model(cfg, rank=8)
    assert fm["weight_bytes"] == 2 * (proj + hf.lm_head.weight.numel())
    assert fm["kv_bytes_per_token"] == 2 * 2 * cfg.num_layers * cfg.kv_dim
    lora = 8 * cfg.num_layers * sum(a + b for a, b in [(128, 128)] * 4 + [(128, 352)] * 2 + [(352, 128)])
    assert fm["adapter_bytes"] == 2 * lora
    # one decode step of 4 rows over 100 KV tokens and 2 adapters; an idle step costs nothing
    t = floor_seconds(fm, [(0, 4, 0.01, 100, 2), (0, 0, 0.01, 0, 0)])
    want = max((fm["weight_bytes"] + 100 * fm["kv_bytes_per_token"] + 2 * fm["adapter_bytes"]) / 4.2e12,
               (4 * fm["flops_per_row"] + 4 * fm["lm_head_flops"]) / 7.7e14)
    assert abs(t - want) < 1e-15
    assert (fm["bandwidth"], fm["matmul"]) == (4.2e12, 7.7e14)  # no card given: the H200's measured rates
    # a card's own rates: a step bound by its bytes takes half as long at twice the bandwidth
    fast = floor_model(cfg, rank=8, rates={"bandwidth": 8.4e12, "matmul": 7.7e14})
    step = [(0, 1, 0.01, 100, 2)]
    nbytes = fm["weight_bytes"] + 100 * fm["kv_bytes_per_token"] + 2 * fm["adapter_bytes"]
    assert nbytes / 8.4e12 > (fm["flops_per_row"] + fm["lm_head_flops"]) / 7.7e14  # bytes-bound even at 8.4 TB/s
    assert abs(floor_seconds(fast, step) - floor_seconds(fm, step) / 2) < 1e-15


def test_interference_run_measures_decoders_and_cleans_up(tiny_llama, tmp_path):
    from lorafleet.bench.e2e import run_interference
    from lorafleet.runner.config import EngineConfig
    from lorafleet.runner.engine.engine import Engine

    eng = Engine(str(tiny_llama), EngineConfig(device="cpu", max_batch_size=4, page_size=4, num_pages=600,
                                                chunked_prefill=True, max_step_tokens=24))
    res = run_interference(eng, 512, lambda m: None, long_len=90, n_long=2, every=3, quiet_steps=6)
    assert res["decoders"] == 3 and res["long_prompts"] == 2 and res["max_step_tokens"] == 24
    assert 0 < res["itl_p50_quiet_ms"] and 0 < res["itl_p50_ms"] <= res["itl_p99_ms"] <= res["itl_max_ms"]
    assert res["itl_p99_over_p50"] == round(res["itl_p99_ms"] / res["itl_p50_quiet_ms"], 3)
    # the control ran the same decoders for as many steps as the loaded phase, without long prompts
    assert res["loaded_steps"] >= 2 * 90 // 24 and 0 < res["itl_p50_control_ms"] <= res["itl_p99_control_ms"]
    assert res["itl_p99_over_control_p50"] == round(res["itl_p99_ms"] / res["itl_p50_control_ms"], 3)
    # per-step wall times: the loaded phase has steps with prompt rows, the control none
    ld, ct = res["loaded_step_ms"], res["control_step_ms"]
    assert ld["with_prompt_rows"]["steps"] >= 90 // 24 and ct["with_prompt_rows"]["steps"] == 0
    assert ld["with_prompt_rows"]["steps"] + ld["decode_only"]["steps"] == res["loaded_steps"]
    assert ct["decode_only"]["steps"] == res["loaded_steps"]
    assert 0 < ct["decode_only"]["p50"] <= ct["decode_only"]["p99"]
    assert res["long_ttft_s"] > 0 and res["decode_prefill_tokens"] is None
    assert not eng.has_work() and eng.blocks.free_pages == eng.blocks.num_pages
    assert "mixed_step_profile" not in res

    # with adapters (every request its own name over two weight sets) and a profile: one more long prompt
    # whose chunks ride with the decodes, then quiet steps
    from model_helpers import write_random_adapter

    sets = [write_random_adapter(tiny_llama, tmp_path / f"w{k}", r=4, seed=k) for k in range(2)]
    eng.batcher.decode_prefill_tokens = 8
    res = run_interference(eng, 512, lambda m: None, long_len=90, n_long=1, every=3, quiet_steps=4, profile=True,
                           adapter_source=lambda i: str(sets[i % 2]))
    assert res["adapters"] and res["itl_p99_over_control_p50"] > 0
    assert eng.adapters.stats["loads"] >= 2  # the decoders' adapters were loaded
    mixed, quiet = res["mixed_step_profile"], res["quiet_step_profile"]
    host = res["mixed_step_host"]
    assert host["wall_ms_unprofiled"] > 0 and "function calls" in host["cprofile_tottime"]
    assert mixed["wall_ms"] > 0 and quiet["wall_ms"] > 0
    assert mixed["host_and_gaps_ms"] == round(mixed["wall_ms"] - sum(
        v for k, v in mixed.items() if k not in ("wall_ms", "host_and_gaps_ms", "top_kernels", "rows", "gaps")), 3)
    assert any(p > 0 for p, _ in mixed["rows"]) and all(p == 0 for p, _ in quiet["rows"])
    assert not eng.has_work() and eng.blocks.free_pages == eng.blocks.num_pages


def test_breakdown_profiles_steps_with_prompt_rows_while_the_batch_fills(tiny_llama, tmp_path):
    from model_helpers import write_random_adapter

    from lorafleet.bench.e2e import profile_breakdown
    from lorafleet.runner.config import EngineConfig
    from lorafleet.runner.engine.engine import Engine

    sets = [write_random_adapter(tiny_llama, tmp_path / f"w{k}", r=4, seed=k) for k in range(2)]
    eng = Engine(str(tiny_llama), EngineConfig(device="cpu", max_batch_size=6, page_size=4, num_pages=600,
                                                chunked_prefill=True, max_step_tokens=24))
    rng = np.random.default_rng(0)
    reqs = [(rng.integers(3, 500, 20).tolist(), 8) for _ in range(6)]
    lines = []
    out = profile_breakdown(eng, reqs, lines.append, lambda i: str(sets[i % 2]), mixed_steps=2)
    # the decode profile ran at full batch; the other one while half the batch decoded and prompts waited
    assert out["rows"] == [(0, 6)] * 10
    mixed = out["mixed"]
    assert len(mixed["rows"]) == 2 and all(p > 0 and d >= 3 for p, d in mixed["rows"])
    assert mixed["wall_ms"] > 0 and any("prompt rows" in ln for ln in lines)
    assert not any("carried no prompt rows" in ln for ln in lines)
    assert not eng.has_work() and eng.blocks.free_pages == eng.blocks.num_pages

    # at a longer context: each profiled prompt is the request's tokens repeated to 50
    seen = []
    submit = eng.submit
    eng.submit = lambda seq: (seen.append(list(seq.prompt_ids)), submit(seq))[1]
    try:
        profile_breakdown(eng, reqs, lines.append, lambda i: str(sets[i % 2]), mixed_steps=0, context=50)
    finally:
        eng.submit = submit
    assert [len(p) for p in seen] == [50] * 6
    assert all(p == (ids * 3)[:50] for p, (ids, _) in zip(seen, reqs))
    assert not eng.has_work() and eng.blocks.free_pages == eng.blocks.num_pages

    # asked for more steps than prompts wait for: it stops when none waits, so no decode-only step is
    # averaged in
    reqs = [(rng.integers(3, 500, 20).tolist(), 8) for _ in range(6)]
    out = profile_breakdown(eng, reqs, lines.append, lambda i: str(sets[i % 2]), mixed_steps=20)
    rows = out["mixed"]["rows"]
    assert 1 <= len(rows) <= 3 and all(p > 0 for p, _ in rows)
    assert not eng.has_work() and eng.blocks.free_pages == eng.blocks.num_pages

    # with the floor model: the adapters' bytes at the floor's bandwidth beside the LoRA kernels' time, one
    # adapter for the whole batch (`identical`) or one per request
    import json

    from lorafleet.bench.e2e import floor_model
    from lorafleet.models.registry import config_from_hf

    fm = floor_model(config_from_hf(json.loads((tiny_llama / "config.json").read_text())), rank=4,
                     rates={"bandwidth": 3.0e12, "matmul": 8.0e14})  # an H100-like card's
    for identical, adapters in ((True, 1), (False, 6)):
        lines.clear()
        reqs = [(rng.integers(3, 500, 20).tolist(), 8) for _ in range(6)]
        out = profile_breakdown(eng, reqs, lines.append, lambda i: str(sets[i % 2]), mixed_steps=0, fm=fm,
                                identical=identical)
        assert out["adapters_per_step"] == adapters
        assert out["lora_bytes_ms"] == round(1000 * adapters * fm["adapter_bytes"] / 3.0e12, 3)
        assert any(("one adapter" if identical else "6 distinct adapters") in ln and "adapters' bytes" in ln
                   for ln in lines)
        assert not eng.has_work() and eng.blocks.free_pages == eng.blocks.num_pages

    # an engine without LoRA: no adapters submitted, no byte figures; the exposed LoRA time is the walls' difference
    from lorafleet.bench.e2e import exposed_report, lora_exposed

    off_eng = Engine(str(tiny_llama), EngineConfig(device="cpu", max_batch_size=6, page_size=4, num_pages=600,
                                                   enable_lora=False))
    lines.clear()
    off = profile_breakdown(off_eng, reqs, lines.append, mixed_steps=0, fm=fm, lora=False)
    assert off["wall_ms"] > 0 and "adapters_per_step" not in off and "lora_bytes_ms" not in off
    assert not any("adapters' bytes" in ln for ln in lines) and any("device idle" in ln for ln in lines)
    assert not off_eng.has_work()
    assert off["wall_ms_unprofiled"] > 0 and out["wall_ms_unprofiled"] > 0  # the steps timed without the profiler too
    res = {"breakdown_lora_distinct": {"wall_ms": 7.25}, "breakdown_lora_identical": {"wall_ms": 6.5}}
    assert lora_exposed(res, {"wall_ms": 6.0}) == {"distinct": 1.25, "identical": 0.5}
    assert lora_exposed({"breakdown_lora_distinct": {"wall_ms": 7.0}}, {"wall_ms": 6.0}) == {"distinct": 1.0}
    # unprofiled walls where both have them
    assert lora_exposed({"breakdown_lora_distinct": {"wall_ms": 7.0, "wall_ms_unprofiled": 6.5}},
                        {"wall_ms": 6.0, "wall_ms_unprofiled": 5.75}) == {"distinct": 0.75}
    assert lora_exposed({"breakdown_lora_distinct": {"wall_ms": 7.0, "wall_ms_unprofiled": 6.5}},
                        {"wall_ms": 6.0}) == {"distinct": 1.0}
    # the exposed time over the adapters' bytes' time, where the breakdown has one
    res = {"breakdown_lora_distinct": {"lora_bytes_ms": 0.5}, "breakdown_lora_identical": {}}
    ratios, said = exposed_report(res, {"distinct": 1.25, "identical": 0.5})
    assert ratios == {"distinct": 2.5}
    assert said == "distinct 1.25 ms (2.5x its adapters' bytes, 0.5 ms), identical 0.5 ms"

    # every prompt admitted in the first step: nothing to profile, and the log says so
    big = Engine(str(tiny_llama), EngineConfig(device="cpu", max_batch_size=4, page_size=4, num_pages=600,
                                               chunked_prefill=True, max_step_tokens=200))
    lines.clear()
    out = profile_breakdown(big, reqs[:4], lines.append, lambda i: str(sets[i % 2]), mixed_steps=2)
    assert "mixed" not in out and any("no step with prompt rows" in ln for ln in lines)


def test_prefill_rate_times_every_prompt_token_once_with_the_cache_off(tiny_llama, tmp_path):
    """The prefill benchmark: each prompt computed in full (no cached pages, even for repeated prompts), the
    adapters loaded before the timed part, the prefix cache switched back on afterwards."""
    from model_helpers import write_random_adapter

    from lorafleet.bench.e2e import prefill_rate
    from lorafleet.runner.config import EngineConfig
    from lorafleet.runner.engine.engine import Engine

    sets = [write_random_adapter(tiny_llama, tmp_path / f"w{k}", r=4, seed=k) for k in range(2)]
    eng = Engine(str(tiny_llama), EngineConfig(device="cpu", max_batch_size=4, page_size=4, num_pages=600,
                                                chunked_prefill=True, max_step_tokens=64))
    assert eng.blocks.caching
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, 100).tolist() for _ in range(3)]
    prompts.append(list(prompts[0]))  # a repeat would hit the cache if it were on
    lines = []
    for adapters in ([None] * 4, [("one", str(sets[0]))] * 4, [(f"d{i}", str(sets[i % 2])) for i in range(4)]):
        hits = eng.blocks.stats["hits"]
        res = prefill_rate(eng, prompts, adapters, "prefill", lines.append)
        assert res["prompts"] == 4 and res["prompt_tokens"] == 400
        assert res["steps"] >= 400 // 64 and abs(res["prompt_tok_s"] * res["seconds"] - 400) < 400 * 0.02
        assert eng.blocks.stats["hits"] == hits and eng.blocks.caching
        assert not eng.has_work() and eng.blocks.free_pages == eng.blocks.num_pages
    assert len(lines) == 3 and all("prompt tokens/s" in ln for ln in lines)
    # with the profile: four more steps' device time and kernels (none on the CPU: the categories stay zero), each a
    # step of the profiled prompts' rows, and the engine drained afterwards
    res = prefill_rate(eng, prompts, [("one", str(sets[0]))] * 4, "prefill", lines.append, profile=True)
    prof = res["profile"]
    assert len(prof["rows"]) == 4 and all(r[0] == 64 for r in prof["rows"]) and prof["wall_ms"] > 0
    assert set(prof) >= {"dense_gemm", "lora_sgmv", "other_gpu", "top_kernels"}
    assert not eng.has_work() and eng.blocks.free_pages == eng.blocks.num_pages
    assert any(ln.strip().startswith("per prefill step (ms)") for ln in lines[3:])


def test_each_mix_run_starts_with_an_empty_prefix_cache(tiny_llama, tmp_path):
    """Runs one after another on one engine (as bench e2e's mixes do) compute every prompt token again: the
    identical mix must not find the pages an earlier run of the same adapter left in the cache."""
    from model_helpers import write_random_adapter

    from lorafleet.bench.e2e import run_mix
    from lorafleet.runner.config import EngineConfig
    from lorafleet.runner.engine.engine import Engine

    w = write_random_adapter(tiny_llama, tmp_path / "w0", r=4, seed=0)
    eng = Engine(str(tiny_llama), EngineConfig(device="cpu", max_batch_size=4, page_size=4, num_pages=600))
    rng = np.random.default_rng(2)
    reqs = [(rng.integers(3, 500, 40).tolist(), 3) for _ in range(4)]
    prompt = sum(len(ids) for ids, _ in reqs)
    for names in (["one"] * 4, ["one"] * 4, [None] * 4, [None] * 4):
        res = run_mix(eng, reqs, names, lambda i: w, "mix", lambda *a: None)
        assert res["prefill_tokens"] == prompt and res["prompt_tokens_cached"] == 0, res
    assert eng.blocks.caching


def test_kernel_categories_of_the_profiled_kernels():
    from lorafleet.bench.e2e import kernel_category

    names = {  # kernel names as the profiler reports them on the H200
        "nvjet_sm90_tst_192x32_64x7_4x1_v_bz_TNT": "dense_gemm",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "dense_gemm",
        "void lorafleet::(anonymous namespace)::sgmv_expand_kernel<__nv_bfloat16, false>(ExpandParams)": "lora_sgmv",
        "void flashinfer::BatchDecodeWithPagedKVCacheKernel<(flashinfer::PosEncodingMode)0, 2u, 4u>": "attention",
        "void flashinfer::BatchPrefillWithPagedKVCacheKernel<KernelTraits>": "attention",
        "void flashinfer::PrefillWithKVCacheKernel<SparseCollectiveMainloop>": "attention",
        "void flashinfer::BlockSparseIndicesToVectorSparseOffsetsKernel<int>(int*, int*, int*)": "attention",
        "void flashinfer::VariableLengthMergeStatesKernel<8u, 16u, 8u, 4u, __nv_bfloat16>": "attention",
        "void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*)": "other_gpu",
        "void flashinfer::activation::act_and_mul_kernel<__nv_bfloat16, &(silu(float const&))>": "other_gpu",
        "void lorafleet::(anonymous namespace)::rope_kv_kernel<__nv_bfloat16>(lorafleet::RopeKvArgs)": "other_gpu",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>": "sampling",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "allreduce",
    }
    assert {n: kernel_category(n) for n in names} == names


def test_tensor_parallel_benchmark_path_on_the_cpu(tmp_path):
    """`lorafleet bench e2e --tp 2` (what runs Llama-2-70B over two GPUs) end to end on a tiny shape
    with two gloo ranks, through the CLI (the ranks are spawned from `python -m lorafleet`):
    synthetic weights on every rank, synthetic adapters through the slot mirror, every mix finished,
    summaries against LoRA off and the floor, and with --profile the decode step of each mix and of LoRA off."""
    import json
    import subprocess
    import sys

    out = tmp_path / "tp.json"
    cmd = [sys.executable, "-m", "lorafleet", "--log-level", "WARNING", "bench", "e2e", "--shape", "tiny", "--tp", "2",
           "--requests", "2", "--max-batch", "4", "--mixes", "distinct", "identical", "--population", "3",
           "--rank", "4", "--profile", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    s = res["tp"]["tiny_tp2"]
    assert set(s["output_tok_s"]) == {"distinct", "identical"} and s["lora_off_output_tok_s"] > 0
    # --profile: full-batch decode steps of both mixes and of LoRA off, and LoRA's exposed time per step
    for k in ("breakdown_lora_distinct", "breakdown_lora_identical", "breakdown_lora_off"):
        assert s[k]["wall_ms_unprofiled"] > 0, k
    assert s["breakdown_lora_identical"]["adapters_per_step"] == 1 and "lora_bytes_ms" not in s["breakdown_lora_off"]
    assert set(s["lora_exposed_ms"]) == {"distinct", "identical"}
    assert all(r["output_tokens"] > 0 and r["tp"] == 2 for r in res["runs"])
    assert all(v > 0 for v in s["floor_tok_s"].values()) and set(s["over_lora_off"]) == {"distinct", "identical"}
    assert "| distinct tp=2 |" in proc.stdout
    # without a CUDA device the floor is at the H200's measured rates, and the record says it was not measured
    import torch

    if not torch.cuda.is_available():
        assert s["floor_rates"]["bandwidth"] == 4.2e12 and s["floor_rates"]["measured"] is False


def test_interference_caps_only_needs_caps(capsys):
    """`--interference-caps-only` without `--interference` and `--decode-prefill-tokens` would run nothing:
    refused before any model is built, with a message that names what is missing."""
    from lorafleet.bench.e2e import main

    for argv in (["--interference-caps-only"], ["--interference", "--interference-caps-only"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert "--interference-caps-only needs --interference and --decode-prefill-tokens" in capsys.readouterr().err


def test_help_states_every_options_default(capsys):
    """`lorafleet bench e2e --help`: every option with a default (other than None or off) says it in its help,
    and every option says what it does; the help `main` prints is the parser's."""
    import argparse
    import re

    from lorafleet.bench.e2e import build_parser, main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert text == build_parser().format_help()
    options = text.split("\noptions:\n", 1)[1]
    entries = {}
    for entry in re.split(r"\n(?=  -)", options):  # one entry per option: "  --flag METAVAR  help..."
        flag, *rest = entry.split(None, 1)
        entries[flag.rstrip(",")] = " ".join(" ".join(rest).split())
    checked = []
    for action in build_parser()._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[0]
        assert flag in entries, f"{flag} not in the help"
        assert action.help and len(action.help) > 8, f"{flag}: no help"
        if not any(action.default is v for v in (None, False, argparse.SUPPRESS)):  # 0 is a default to state
            assert "default" in entries[flag].lower(), f"{flag}: no default in {entries[flag]!r}"
            checked.append(flag)
    assert {"--requests", "--max-batch", "--mixes", "--population", "--rank", "--sweep", "--hf-requests",
            "--hf-tokens", "--shape", "--tp", "--seed", "--out"} <= set(checked)
    assert "(default: 1000)" in entries["--requests"] and "(default: bench_e2e.json)" in entries["--out"]


def test_prefix_workloads_run_with_the_cache_off_and_on(tiny_llama):
    """The prefix cache's benchmark workloads on a small engine: with the cache on, the shared system prompts
    and the conversations' earlier turns are not computed again; with nothing shared, nothing is found."""
    from lorafleet.bench.prefix import run_workloads
    from lorafleet.runner.config import EngineConfig
    from lorafleet.runner.engine.engine import Engine

    eng = Engine(str(tiny_llama), EngineConfig(device="cpu", max_batch_size=8, page_size=8, num_pages=800,
                                                enable_lora=False))
    reqs = [(list(range(3 + i, 30 + i)), 4) for i in range(12)]
    logs = []
    out = run_workloads(_no_adapters(eng), ["system-prompt", "multi-turn", "sharegpt"], reqs, 512, logs.append,
                        adapters=3, system_tokens=64, conversations=4, user_tokens=(10, 40), output_tokens=(8, 30))
    sp, mt, sg = out["system-prompt"], out["multi-turn"], out["sharegpt"]
    assert sp["off"]["prompt_tokens_cached"] == 0 and sp["off"]["prompt_tokens_computed"] == sp["off"]["prompt_tokens"]
    # 12 requests over 3 system prompts of 64 tokens (8 pages): at least 9 of them find their system prompt
    assert sp["on"]["prompt_tokens_cached"] >= 9 * 64
    assert sp["on"]["prompt_tokens_computed"] == sp["on"]["prompt_tokens"] - sp["on"]["prompt_tokens_cached"]
    assert mt["on"]["prompt_tokens_computed"] < 0.6 * mt["off"]["prompt_tokens_computed"]
    assert mt["on"]["requests"] == 16 and "ttft_later_turns_p50_s" in mt["on"]
    assert sg["on"]["prompt_tokens_cached"] == 0
    assert set(sp["on_over_off"]) >= {"output_tok_s", "ttft_p50", "prompt_tokens_computed"} and len(logs) == 6


def test_prefix_workloads_at_a_rate_submit_each_request_at_its_arrival(tiny_llama):
    """With `rate`, requests arrive as a Poisson process: none is submitted before its arrival time, the run
    lasts at least until the last arrival, and TTFT counts from each request's own arrival."""
    import time

    from lorafleet.bench.prefix import arrivals, run_workloads
    from lorafleet.runner.config import EngineConfig
    from lorafleet.runner.engine.engine import Engine

    at = arrivals(200, 50.0, seed=3)
    assert at[0] == 0.0 and all(b >= a for a, b in zip(at, at[1:]))
    assert 3.0 < at[-1] < 5.0  # 199 gaps of mean 20 ms
    assert arrivals(4, 0.0) == [0.0] * 4

    eng = _no_adapters(Engine(str(tiny_llama), EngineConfig(device="cpu", max_batch_size=8, page_size=8,
                                                            num_pages=800, enable_lora=False)))
    submitted = {}
    inner = eng.submit

    def submit(seq):
        submitted[seq.id] = time.perf_counter()
        inner(seq)

    eng.submit = submit
    reqs = [(list(range(3 + i, 30 + i)), 4) for i in range(10)]
    rate = 20.0
    t0 = time.perf_counter()
    out = run_workloads(eng, ["system-prompt"], reqs, 512, lambda _: None, adapters=2, system_tokens=32, rate=rate)
    want = arrivals(len(reqs), rate)
    for run in ("off", "on"):
        assert out["system-prompt"][run]["rate"] == rate and out["system-prompt"][run]["requests"] == 10
    times = sorted(submitted.values())
    assert len(times) == 10  # the second run's submissions overwrite the first's (same ids)
    start = min(times)
    assert start >= t0
    # each submission of the last run no earlier than its arrival after that run's start
    assert all(t - start >= a - 0.01 for t, a in zip(times, want))
    assert out["system-prompt"]["on"]["seconds"] >= want[-1]


def _no_adapters(eng):
    """The workloads name adapters; on this base-only engine every request runs on the base model."""
    real = eng.submit

    def submit(seq):
        seq.adapter = None
        real(seq)

    eng.submit = submit
    return eng


def test_kernel_gaps_attributes_idle_time_to_the_kernel_pair_around_it():
    from lorafleet.bench.e2e import kernel_gaps, kernel_label

    assert kernel_label("void lorafleet::(anonymous namespace)::sgmv_shrink_kernel<__nv_bfloat16, false, false>"
                        "(lorafleet::(anonymous namespace)::ShrinkParams)") == "sgmv_shrink_kernel"
    assert kernel_label("nvjet_sm90_qqsss_192x32_128x7_4x1_v_bz_algo2_TNT") == "nvjet_sm90_qqsss"
    assert kernel_label("void cutlass::device_kernel<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90<2>, "
                        "int> >(flash::FlashAttnFwdSm90<int>::Params)") == "device_kernel<FlashAttnFwdSm90>"
    assert kernel_label("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<int> >(P)") == \
        "device_kernel<GemmUniversal>"
    assert kernel_label("gemvx_kernel") == "gemvx_kernel" and kernel_label("") == ""
    assert kernel_label("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*)") == \
        "FusedAddRMSNormKernel"
    # two steps of: shrink 0-5, gemm 7-20 (2 us idle), epilogue 18-25 (started early: 2 us overlap),
    # norm 26-28 (1 us idle); the second step 100 us later (the host), a GEMM on a second stream inside
    # the first kernel's span (no idle, overlap)
    names = ["void a::shrink_k<int>(P)", "nvjet_sm90_qqsss_x", "void a::epi_k<int>(E)", "void f::Norm<8u>(h*)"]
    spans = []
    for base in (0.0, 128.0):
        spans += [(base + 0, base + 5, names[0]), (base + 7, base + 20, names[1]), (base + 18, base + 25, names[2]),
                  (base + 26, base + 28, names[3])]
    spans.append((1.0, 3.0, "nvjet_sm90_tst_y"))
    g = kernel_gaps(spans, 2)
    pairs = {(p["after"], p["before"]): p for p in g["pairs"]}
    assert pairs[("shrink_k", "nvjet_sm90_qqsss")]["idle_ms_per_step"] == 0.002
    assert pairs[("shrink_k", "nvjet_sm90_qqsss")]["per_step"] == 1 and \
        pairs[("shrink_k", "nvjet_sm90_qqsss")]["mean_us"] == 2.0
    assert pairs[("epi_k", "Norm")]["mean_us"] == 1.0
    assert pairs[("Norm", "shrink_k")]["per_step"] == 0.5 and pairs[("Norm", "shrink_k")]["mean_us"] == 100.0
    assert pairs[("shrink_k", "nvjet_sm90_qqsss")]["median_us"] == 2.0 == pairs[("shrink_k", "nvjet_sm90_qqsss")]["max_us"]
    # one long gap among short ones of the same pair: the median shows the usual gap, the max the outlier
    g3 = kernel_gaps([(0.0, 1.0, names[0]), (1.0, 2.0, names[1]), (50.0, 51.0, names[0]), (52.0, 53.0, names[1]),
                      (54.0, 55.0, names[0]), (56.0, 57.0, names[1])], 3)
    p3 = {(p["after"], p["before"]): p for p in g3["pairs"]}[("shrink_k", "nvjet_sm90_qqsss")]
    assert (p3["per_step"], p3["median_us"], p3["max_us"]) == (0.67, 1.0, 1.0)
    p4 = {(p["after"], p["before"]): p for p in g3["pairs"]}[("nvjet_sm90_qqsss", "shrink_k")]
    assert (p4["median_us"], p4["max_us"], p4["mean_us"]) == (24.5, 48.0, 24.5)  # gaps of 48 and 1 us
    assert ("nvjet_sm90_tst", "nvjet_sm90_qqsss") not in pairs  # the short kernel ended before the shrink
    assert g["idle_ms_per_step"] == round((2 * (2 + 1) + 100) / 2 / 1000, 3)
    assert g["overlap_ms_per_step"] == round((2 * 2 + 4) / 2 / 1000, 3)  # 4: the second stream's start to 5
    assert g["pairs"][0]["before"] == "shrink_k"  # sorted by idle time
    # the timeline by category: the GEMMs 13 us per step (the second stream's GEMM lies inside the shrink's span:
    # nothing), the epilogue only from the GEMM's end (20-25: 5 of its 7 us), the shrink 5 and the norm 2 (all
    # three "other" by name here); with the idle time they add up to the kernels' span (28 us per step)
    ex = g["exclusive_ms_per_step"]
    assert ex == {"dense_gemm": 0.013, "other_gpu": 0.012}
    assert round(sum(ex.values()) + (2 + 1) / 1000, 3) == 0.028


def test_result_files_that_are_missing_broken_or_of_another_bench_are_refused_in_one_line(tmp_path, capsys):
    """`bench e2e --merge / --plot-from` and `bench serve --merge` name the file and what is wrong with it (they
    ended in a traceback: FileNotFoundError, JSONDecodeError, KeyError), and write nothing."""
    import json

    import pytest

    from lorafleet import cli

    good = tmp_path / "good.json"
    good.write_text(json.dumps(_result({"distinct": 100.0, "lora off": 130.0})))
    broken = tmp_path / "broken.json"
    broken.write_text('{"runs": [')
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"card": "\xe9"}')
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"cases": []}))
    serve_file = tmp_path / "serve.json"  # a bench serve result: runs without a label
    serve_file.write_text(json.dumps({"date": "2026-11-30", "runs": [
        {"mix": "distinct", "rate": "inf", "output_tok_s": 1.0, "tpot_p50_ms": 2.0}]}))
    out = tmp_path / "m.json"
    cases = [
        (["bench", "e2e", "--merge", str(good), str(tmp_path / "nope.json"), "--out", str(out)],
         "nope.json does not exist"),
        (["bench", "e2e", "--merge", str(broken), "--out", str(out)], "broken.json is not JSON (Expecting value"),
        (["bench", "e2e", "--plot-from", str(latin), "--plot", str(tmp_path / "p.png")], "latin.json cannot be read"),
        (["bench", "e2e", "--merge", str(other), "--out", str(out)],
         "other.json is not a benchmark result file (no list of runs)"),
        (["bench", "e2e", "--merge", str(good), str(serve_file), "--out", str(out)],
         "serve.json is not a result file of bench e2e (no card, requests, max_batch)"),
        (["bench", "serve", "--merge", str(good), "--out", str(out)],
         "good.json is not a result file of bench serve"),
    ]
    for argv, want in cases:
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "Traceback" not in err, (argv, err)
        assert want in err, (argv, err)
        assert not out.exists()


def test_bench_serve_refuses_bad_rates_and_counts_in_one_line(capsys):
    """`bench serve --rates abc` / `-1` ended in a traceback after the server had started (float('abc'), numpy's
    exponential with a negative scale); they and zero counts are now refused before anything starts."""
    import pytest

    from lorafleet import cli

    cases = [(["--rates", "abc"], "'abc' is not a rate"), (["--rates", "4", "-1"], "'-1' is not a rate"),
             (["--rates", "nan"], "'nan' is not a rate"), (["--rates", "1e999"], "is not a rate"),
             (["--requests", "0"], "--requests: must be at least 1"), (["--population", "-3"], "--population"),
             (["--rank", "0"], "--rank"), (["--slo-tpot", "0"], "--slo-tpot"), (["--max-output", "0"], "--max-output")]
    for argv, want in cases:
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", "serve", *argv])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "Traceback" not in err and want in err, (argv, err)
    from lorafleet.bench.serve import build_parser, parse_rate

    args = build_parser().parse_args(["--rates", "inf", "0.5", " 4 "])
    assert [parse_rate(r) for r in args.rates] == [None, 0.5, 4.0]
