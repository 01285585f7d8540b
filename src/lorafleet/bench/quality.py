"""`lorafleet bench quality`: what FP8 weights and FP8 K/V pages cost in quality, on a real model.

The engine's own layer loop scores a fixed text (default: a public-domain text shipped with the package, 1,337 words)
in windows, teacher-forced, for the base model and each adapter, once per precision: the model's dtype
(bf16 on a GPU, fp32 on the CPU), FP8 weights, FP8 weights + FP8 K/V pages. Reported: perplexity per
precision and its ratio to the first, and the top-1 agreement of every other precision with the first
over all scored positions.

    lorafleet bench quality --out quality.json          # the demo model (SmolLM2-135M) and its adapters
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from datetime import date
from pathlib import Path

from lorafleet.common import cli_args

PRECISIONS = {"model": {}, "fp8": {"quantization": "fp8"}, "fp8_kv8": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}
DEFAULT_TEXT = Path(__file__).resolve().parent / "declaration.txt"


class QualityInputError(ValueError):
    """Input the benchmark cannot score (a text too short, one that is not UTF-8)."""


def window_logits(engine, ids: list[int], adapter=None):
    """fp32 logits [T, V] of every position of `ids` (one prefill on fresh pages; with `adapter`, an
    AdapterRef, through its LoRA)."""
    import torch

    from lorafleet.runner.executor.attention.meta import AttnMeta
    from lorafleet.runner.lora.segments import build_segments
    from lorafleet.runner.lora.step import LoraStepImpl
    from lorafleet.runner.lora.manager import READY
    from lorafleet.runner.model.decoder import StepIO

    dev, ps, T = engine.device, engine.config.page_size, len(ids)
    pages: list[int] = []
    if not engine.blocks.grow(pages, T):
        raise RuntimeError(f"a window of {T} tokens does not fit the KV cache")
    slot = -1
    try:
        lora = None
        if adapter is not None:
            for _ in range(100000):
                status, slot = engine.adapters.acquire(adapter)
                if status == READY:
                    break
                time.sleep(0.01)
            lora = LoraStepImpl(engine.lora_pool, engine.sgmv, build_segments([slot] * T, dev, capacity=1))
        pos = torch.arange(T)
        slots = torch.tensor([pages[p // ps] * ps + p % ps for p in range(T)], dtype=torch.int64)
        io = StepIO(torch.tensor(ids, device=dev), pos.to(dev), slots.to(dev), pos.to(dev))
        meta = AttnMeta(num_prefill=1, qo_indptr=[0, T], kv_lens=[T], page_tables=[pages], page_size=ps,
                        slot_mapping=io.slots)
        return engine.model.forward(io, engine.attention.begin(meta), lora).float()
    finally:
        engine.blocks.release(pages)
        if slot >= 0:
            engine.adapters.release(slot)


def score(engine, ids: list[int], adapter, window: int):
    """(summed negative log-likelihood, positions, argmax of every scored position) over the text in windows."""
    import torch

    nll, n, top1 = 0.0, 0, []
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start: start + window + 1]
        if len(chunk) < 2:
            break
        logits = window_logits(engine, chunk[:-1], adapter)
        target = torch.tensor(chunk[1:], device=logits.device)
        nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        n += len(chunk) - 1
        top1.append(logits.argmax(-1).cpu())
    return nll, n, torch.cat(top1)


def run(model: str, text: str, adapters: dict, device: str, window: int, precisions: list[str], log,
        dtype: str = "auto") -> dict:
    import torch

    from lorafleet.runner.config import EngineConfig
    from lorafleet.runner.engine.engine import Engine
    from lorafleet.runner.engine.sequence import AdapterRef
    from lorafleet.scheduler.tokenizer import Tokenizer

    ids = Tokenizer(model).encode(text)
    if len(ids) < 2:
        raise QualityInputError(f"the text to score is {len(ids)} token(s) long; perplexity needs at least 2")
    res: dict = {"model": model, "tokens": len(ids), "window": window, "device": device, "dtype": dtype, "precisions": {}}
    firsts = {}
    for name in precisions:
        cfg = EngineConfig(device=device, dtype=dtype, max_batch_size=4, max_lora_rank=64, kv_cache_gb=0.5, num_pages=None,
                           **PRECISIONS[name])
        eng = Engine(model, cfg)
        try:
            per = {}
            for label, path in [("base", None), *sorted(adapters.items())]:
                ref = AdapterRef(label, str(path)) if path is not None else None
                nll, n, top1 = score(eng, ids, ref, window)
                entry = {"ppl": round(math.exp(nll / n), 4), "positions": n}
                if name == precisions[0]:
                    firsts[label] = top1
                else:
                    entry["top1_agreement"] = round(float((top1 == firsts[label]).float().mean()), 4)
                per[label] = entry
            res["precisions"][name] = {"dtype": str(eng.dtype).replace("torch.", ""), "by_model": per}
        finally:
            eng.close()
        log(f"{name}: " + ", ".join(f"{k} ppl {v['ppl']}" + (f" top-1 {v['top1_agreement']:.3f}" if "top1_agreement" in v
                                                             else "") for k, v in per.items()))
        del eng
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    first = res["precisions"][precisions[0]]["by_model"]
    summary = {}
    for name in precisions[1:]:
        per = res["precisions"][name]["by_model"]
        positions = sum(v["positions"] for v in per.values())
        summary[name] = {
            "ppl_ratio": {k: round(v["ppl"] / first[k]["ppl"], 4) for k, v in per.items()},
            "top1_agreement": round(sum(v["top1_agreement"] * v["positions"] for v in per.values()) / positions, 4),
            "positions": positions}
    res["summary"] = summary
    return res


def build_parser() -> argparse.ArgumentParser:
    from lorafleet.cli import DocHelpFormatter

    p = argparse.ArgumentParser(prog="lorafleet bench quality", description=__doc__, formatter_class=DocHelpFormatter)
    p.add_argument("--model", type=cli_args.model_dir("config.json", "tokenizer.json"), default=None,
                   help="HF model directory, with its tokenizer.json (default: the demo model, prepared on first use)")
    p.add_argument("--adapters", type=cli_args.existing_dir, default=None,
                   help="a directory of PEFT adapters to score too (default: the demo adapters with the demo model)")
    p.add_argument("--text", type=cli_args.existing_file, default=DEFAULT_TEXT,
                   help="the text to score (default: bench/declaration.txt, shipped with the package)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the engine's dtype in every precision (default: auto, bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--window", type=cli_args.positive_int, default=1024, help="tokens scored per prefill")
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS),
                   help="precisions to score; the first is the reference")
    p.add_argument("--out", type=cli_args.output_file, default=Path("quality.json"),
                   help="results as JSON (default: quality.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model, adapters = args.model, {}
    if model is None:
        from lorafleet.runner.demo import prepare

        d = prepare()
        model, args.adapters = str(d / "model"), args.adapters or d / "adapters"
    if args.adapters:
        adapters = {a.name: a for a in sorted(Path(args.adapters).iterdir()) if (a / "adapter_config.json").is_file()}
    try:
        try:
            text = args.text.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise QualityInputError(f"{args.text} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        res = run(model, text, adapters, args.device, args.window, args.precisions,
                  lambda m: print(m, file=sys.stderr, flush=True), args.dtype)
    except QualityInputError as exc:
        print(f"lorafleet bench quality: error: {exc}", file=sys.stderr)
        return 2
    try:
        import torch

        res["card"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    except Exception:
        res["card"] = "cpu"
    res["date"] = str(date.today())
    args.out.write_text(json.dumps(res, indent=1))
    print("| precision | " + " | ".join(f"ppl {k}" for k in res["precisions"][args.precisions[0]]["by_model"])
          + " | top-1 agreement |")
    print("|---" * (len(res["precisions"][args.precisions[0]]["by_model"]) + 2) + "|")
    for name, r in res["precisions"].items():
        agree = res["summary"].get(name, {}).get("top1_agreement", "-")
        print(f"| {name} ({r['dtype']}) | " + " | ".join(str(v["ppl"]) for v in r["by_model"].values()) + f" | {agree} |")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
