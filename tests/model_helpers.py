"""Small random Llama models and PEFT adapters for tests (import from here, not conftest)."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def write_random_llama(path: Path, *, hidden=128, layers=2, heads=4, kv_heads=4, inter=352, vocab=512,
                       tied=False, seed=0, std=0.08, rope_scaling=None, rope_theta=10000.0, max_positions=512) -> Path:
    """A small random Llama saved as an HF directory (weights with a useful spread of logits)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        tie_word_embeddings=tied, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, initializer_range=std,
        rope_scaling=rope_scaling, rope_theta=rope_theta,
    )
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.8, 1.2)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def write_random_adapter(model_dir: Path, out: Path, *, r=8, alpha=16, targets=("q_proj", "v_proj"), seed=0,
                         scale=0.05, **extra) -> Path:
    """A PEFT LoRA adapter with random non-zero A and B, saved by PEFT itself (`targets`: module names, or a
    regex string PEFT matches against full module names)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets if isinstance(targets, str) else list(targets),
                     lora_dropout=0.0, init_lora_weights=False, task_type="CAUSAL_LM", **extra)
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(str(out))
    return out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_safetensors(path: Path, tensors: dict[str, tuple[int, ...]]) -> None:
    """A valid F32 safetensors file of zeros with the given tensor shapes."""
    header, offset = {}, 0
    for name, shape in tensors.items():
        n = 4
        for s in shape:
            n *= s
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def write_adapter(folder: Path, rank: int = 4, hidden: int = 16) -> Path:
    """A PEFT adapter of zeros on layer 0 q_proj/v_proj, written without torch."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
         "base_model_name_or_path": "tiny-llama"}))
    tensors = {}
    for proj in ("q_proj", "v_proj"):
        tensors[f"base_model.model.model.layers.0.self_attn.{proj}.lora_A.weight"] = (rank, hidden)
        tensors[f"base_model.model.model.layers.0.self_attn.{proj}.lora_B.weight"] = (hidden, rank)
    write_safetensors(folder / "adapter_model.safetensors", tensors)
    return folder


def collect_outputs(eng, seqs) -> dict[str, dict]:
    """Submit `seqs` to engine `eng` and step it until it is done: per request id, the generated ids, their
    log-probability entries, its prompt's entries, and how many step outputs carried each kind of entry."""
    got = {s.id: {"ids": [], "lps": [], "lp_entries": 0, "prompt": [], "prompt_entries": 0} for s in seqs}
    for s in seqs:
        eng.submit(s)
    while eng.has_work():
        for out in eng.step():
            g = got[out.seq_id]
            g["ids"] += out.new_token_ids
            if out.logprobs is not None:
                assert len(out.logprobs) == len(out.new_token_ids)
                g["lps"] += out.logprobs
                g["lp_entries"] += 1
            if out.prompt_logprobs is not None:
                g["prompt"] += out.prompt_logprobs
                g["prompt_entries"] += 1
    return got
