"""`lorafleet bench cpu`: the SmolLM2 demo on CPU, 16 mixed-adapter requests, lorafleet vs HF+PEFT.

Both do the same work in the same run: 16 chat requests (4 each for the base model and
the three demo adapters), greedy, exactly `--max-tokens` new tokens each (EOS ignored).
HF+PEFT runs them as one mixed batch (`generate(adapter_names=...)`, left padding).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

from lorafleet.common import cli_args

QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "Give me a tip for learning to cook.",
             "Tell me about the moon."]
ADAPTERS = [None, "pirate", "shouty", "terse"]


def build_parser() -> argparse.ArgumentParser:
    from lorafleet.cli import DocHelpFormatter

    p = argparse.ArgumentParser(prog="lorafleet bench cpu", description=__doc__, formatter_class=DocHelpFormatter)
    p.add_argument("--requests", type=cli_args.positive_int, default=16,
                   help="chat requests, taking turns over the base model and the three demo adapters")
    p.add_argument("--max-tokens", type=cli_args.positive_int, default=64,
                   help="new tokens of every request (EOS ignored)")
    p.add_argument("--threads", type=cli_args.positive_int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", type=cli_args.output_file, default=None,
                   help="write the results as JSON (default: not written)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lorafleet.runner.config import EngineConfig
    from lorafleet.runner.demo import prepare
    from lorafleet.runner.engine.engine import Engine
    from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence
    from lorafleet.scheduler.tokenizer import Tokenizer

    demo = prepare()
    model_dir, adapters = demo / "model", demo / "adapters"
    tok = Tokenizer(model_dir)
    reqs = [(ADAPTERS[i % 4], tok.encode_chat([{"role": "user", "content": QUESTIONS[(i // 4) % 4]}]))
            for i in range(args.requests)]
    n_out = args.max_tokens * len(reqs)

    eng = Engine(str(model_dir), EngineConfig(max_batch_size=32, kv_cache_gb=0.25, device="cpu"))
    seqs = [Sequence(str(i), ids, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
                     AdapterRef(a, str(adapters / a)) if a else None) for i, (a, ids) in enumerate(reqs)]
    t0 = time.perf_counter()
    out = eng.run_to_completion(seqs)
    ours_s = time.perf_counter() - t0
    assert sum(len(o.output_ids) for o in out.values()) == n_out

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(adapters / "pirate"), adapter_name="pirate").eval()
    model.load_adapter(str(adapters / "shouty"), adapter_name="shouty")
    model.load_adapter(str(adapters / "terse"), adapter_name="terse")
    width = max(len(ids) for _, ids in reqs)
    input_ids = torch.tensor([[2] * (width - len(ids)) + ids for _, ids in reqs])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in reqs])
    names = [a or "__base__" for a, _ in reqs]
    t0 = time.perf_counter()
    with torch.no_grad():
        gen = model.generate(input_ids=input_ids, attention_mask=mask, adapter_names=names, do_sample=False,
                             max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, pad_token_id=2)
    hf_s = time.perf_counter() - t0
    assert gen.shape[1] - width == args.max_tokens

    res = {"cpu": {"date": str(date.today()), "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
                   "torch": torch.__version__, "requests": len(reqs), "max_tokens": args.max_tokens,
                   "lorafleet_tok_s": round(n_out / ours_s, 1), "hf_peft_tok_s": round(n_out / hf_s, 1),
                   "speedup": round(hf_s / ours_s, 2)}}
    print("| engine | output tokens | seconds | tok/s |", file=sys.stdout)
    print("|---|---|---|---|")
    print(f"| lorafleet generate (one mixed batch) | {n_out} | {ours_s:.1f} | {n_out / ours_s:.1f} |")
    print(f"| HF transformers + PEFT (mixed-adapter batch) | {n_out} | {hf_s:.1f} | {n_out / hf_s:.1f} |")
    print(f"lorafleet / HF+PEFT = {hf_s / ours_s:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))
    return 0
