"""Typed, frozen configuration of the model and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from lorafleet.common.peft_config import BaseShape

SUPPORTED_ROPE = ("default", "linear", "llama3")


class ModelConfigError(ValueError):
    """The model's config.json describes something this engine cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()  # sorted (key, value) pairs of the rope scaling dict; () = none
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_scaling_dict(self) -> dict:
        return dict(self.rope_scaling)

    def base_shape(self) -> BaseShape:
        return BaseShape(self.num_layers, self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim, self.name)

    @classmethod
    def from_hf(cls, cfg: dict, name: str = "") -> "ModelConfig":
        """Build from a Hugging Face `config.json` (transformers 4.x or 5.x layout)."""
        mt = cfg.get("model_type", "llama")
        if mt not in ("llama", "mistral") and "LlamaForCausalLM" not in (cfg.get("architectures") or []):
            raise ModelConfigError(f"model_type {mt!r} is not a Llama-architecture model")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"hidden_act {act!r} is not supported (Llama uses silu)")
        if cfg.get("sliding_window"):
            raise ModelConfigError("sliding-window attention is not supported")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
        if rope_type not in SUPPORTED_ROPE:
            raise ModelConfigError(f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE)})")
        rope = {k: v for k, v in rope.items() if k not in ("type",)}
        rope["rope_type"] = rope_type
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=tuple(sorted((k, v) for k, v in rope.items() if not isinstance(v, (list, dict)))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            name=name or cfg.get("_name_or_path", ""),
        )


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs. `None` fields are derived from the device at start."""

    max_batch_size: int = 32
    page_size: int = 16
    num_pages: int | None = None  # KV pages; None: from kv_fraction (GPU) or kv_cache_gb (CPU)
    kv_fraction: float = 0.85  # GPU: share of free memory (after weights and adapters) for the KV pool
    kv_cache_gb: float = 1.0  # CPU: KV pool size
    max_lora_rank: int = 64
    lora_slots: int | None = None  # adapters resident in the device pool; None: 8 on CPU, 64 on GPU
    host_lora_cache: int = 256  # adapters kept in (pinned) host memory behind the device pool
    adapter_readers: int | None = None  # CUDA: processes reading adapters from disk; None: half the CPUs, 2..8
    max_prefill_tokens: int = 8192  # unchunked: prompt tokens per step (one longer prompt still runs alone)
    # Chunked prefill: at most this many token rows per step, decodes included; long prompts are split
    # across steps. None: 2048 when chunked_prefill is on (the default on CUDA), else unchunked.
    max_step_tokens: int | None = None
    # Chunked prefill, steps that carry decodes: at most this many prompt rows ride along (a smaller
    # chunk keeps such a step close to a decode-only one, so a long prompt barely delays the decoding
    # requests; its own first token comes later). None: the step budget alone limits them.
    decode_prefill_tokens: int | None = None
    chunked_prefill: bool | None = None  # None: on for CUDA, off for CPU
    # Overlapped scheduling: build and queue step N+1 while the device runs step N. None: on for CUDA.
    overlap: bool | None = None
    # Admission batching: while requests run, wait until this many batch places are free (or as many
    # as requests wait) before admitting, for at most admit_wait_steps steps, so that prompts are
    # prefilled together in fewer mixed steps. None: max_batch_size // 8 on CUDA, 1 (off) on CPU.
    admit_batch: int | None = None
    admit_wait_steps: int = 8
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    enable_lora: bool = True
    cuda_graphs: bool = True
    piecewise_graphs: bool = True  # CUDA: steps with prefill replay graphs around eager attention
    requeue_evicted: bool = False  # offline: resume evicted requests here; service: report them
    tp: int = 1  # tensor parallelism: GPUs of this node driven as one engine (ranks 1..tp-1 in child processes)
    allow_synthetic: bool = False  # benchmarks: accept synthetic://SEED adapter sources (never from the network)
    extra: dict = field(default_factory=dict, compare=False)

    def adapter_reader_count(self) -> int:
        """Processes that read adapters from disk (CUDA engines): `adapter_readers`, or half the CPUs
        between 2 and 8 (each read keeps one CPU busy for a fraction of a second)."""
        if self.adapter_readers is not None:
            return max(1, self.adapter_readers)
        import os

        return min(8, max(2, (os.cpu_count() or 4) // 2))
