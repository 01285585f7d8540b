"""The model contract: what a family module declares, and the typed config every part of lorafleet reads.

No torch here: the operator (base-model check), the scheduler and the runner all read it.

A family module (`llama.py`, `qwen2.py`, ...) builds one `Family`:

    FAMILY = Family(name="qwen2", architectures=("Qwen2ForCausalLM",), model_types=("qwen2",),
                    config=config_from_hf, checkpoint=Checkpoint(...), gguf=Gguf(...))

- `config(hf_config_dict, name) -> ModelConfig`: the mapping from `config.json` (norm kind, activation,
  biases, q/k norms, embedding scale, RoPE per layer, attention window per layer, soft-caps);
- `checkpoint`: the checkpoint's tensor names. Projections that share one checkpoint module are fused in
  the checkpoint (Phi-3's fused qkv and gate-up projections), their rows in `PROJECTIONS` order; the same table
  names the PEFT modules an adapter may target;
- `gguf`: the GGUF architecture and tensor names, when the family loads from GGUF.

Everything the engine runs is generic over `ModelConfig` (runner/model/decoder.py); tensor-parallel split
dimensions are the engine's (`SPLIT_DIM`), the same for every family.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Mapping

# --- projections: the seven LoRA-able linear maps of a decoder layer -------------------------------------

# Index order is the order of the adapter pool's per-layer tables.
PROJECTIONS: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
PROJ_INDEX = {name: i for i, name in enumerate(PROJECTIONS)}
# Projections that read the same input and run as one LoRA launch: qkv, o, gate_up, down.
GROUPS: tuple[tuple[str, ...], ...] = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))
# Tensor parallelism (Megatron): column-parallel projections split their output rows (dim 0 of [out, in]),
# row-parallel ones their input columns (dim 1), followed by one all-reduce.
SPLIT_DIM = {"q": 0, "k": 0, "v": 0, "gate": 0, "up": 0, "o": 1, "down": 1}
# The engine's fused parameters: which projections each stacks, rows in this order.
FUSED = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
# The engine's per-layer norm weights.
NORMS = ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm")


def proj_shape(proj: str, hidden: int, intermediate: int, q_dim: int, kv_dim: int) -> tuple[int, int]:
    """(in_features, out_features) of a projection for a model's dimensions."""
    return {
        "q": (hidden, q_dim),
        "k": (hidden, kv_dim),
        "v": (hidden, kv_dim),
        "o": (q_dim, hidden),
        "gate": (hidden, intermediate),
        "up": (hidden, intermediate),
        "down": (intermediate, hidden),
    }[proj]


class ModelError(ValueError):
    """A base model that cannot be served: the message says why (commands print it, without a traceback)."""


class DeviceError(ModelError):
    """The device asked for is not on this machine (no CUDA, no such GPU)."""


class ModelConfigError(ModelError):
    """The model's config.json describes something this engine cannot run."""


# --- the typed config -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RopeSpec:
    """One rotary embedding: rotate-half convention over the first `rotary_dim` dimensions of each head.

    kind: default | linear (positions / factor) | llama3 (frequency bands) | longrope (per-dimension
    `ext_factors`, the checkpoint's short factors; cos and sin times `attention_factor`; the context stops at
    `original_max_position_embeddings`, past which transformers switches a whole sequence to the long
    factors) | freq_factors (each frequency divided by its `ext_factors` entry: llama.cpp's stored form of
    Llama-3.x scaling)."""

    theta: float
    rotary_dim: int
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    ext_factors: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class BaseShape:
    """The dimensions of a base model that an adapter must fit, and its family (which names the PEFT
    modules an adapter may target)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_dim: int
    kv_dim: int
    name: str = ""
    family: str = "llama"

    def shape(self, proj: str) -> tuple[int, int]:
        return proj_shape(proj, self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim)


@dataclass(frozen=True)
class ModelConfig:
    """Everything the generic decoder needs to know about a model (per layer where it varies)."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ropes: tuple[RopeSpec, ...]  # the distinct rotary embeddings
    layer_rope: tuple[int, ...]  # [num_layers] index into `ropes`
    layer_window: tuple[int | None, ...]  # [num_layers] sliding window W (a query sees the last W keys) or None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma-3)
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w) in fp32 when non-zero (Gemma: 1 + w)
    sandwich_norms: bool = False  # RMSNorm of the attention and MLP outputs before the residual add (Gemma)
    activation: str = "silu"  # silu | gelu_tanh: act(gate) * up
    embed_scale: float | None = None  # embeddings times this (rounded to the weights' dtype), e.g. sqrt(hidden)
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # attention scores: c * tanh(s / c)
    final_softcap: float | None = None  # logits: c * tanh(z / c)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self):
        L = self.num_layers
        if len(self.layer_rope) != L or len(self.layer_window) != L:
            raise ModelConfigError(f"per-layer RoPE and window tables must have {L} entries")
        if any(not 0 <= r < len(self.ropes) for r in self.layer_rope):
            raise ModelConfigError("a layer names a RoPE that does not exist")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ModelConfigError(f"activation {self.activation!r} is not supported (silu, gelu_tanh)")
        # LongRoPE runs with its short factors, which hold up to the original context only
        cap = min((r.original_max_position_embeddings for r in self.ropes if r.kind == "longrope"), default=None)
        if cap is not None and self.max_position_embeddings > cap:
            object.__setattr__(self, "max_position_embeddings", cap)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The distinct attention windows, None (full attention) first."""
        ws = set(self.layer_window)
        return tuple(sorted(ws, key=lambda w: -1 if w is None else w))

    def rope_of(self, layer: int) -> RopeSpec:
        return self.ropes[self.layer_rope[layer]]

    def context_cap_note(self, declared) -> str | None:
        """One line for logs when LongRoPE capped the context below the config's own max_position_embeddings
        (`declared`); None when nothing was capped."""
        longrope = [r.original_max_position_embeddings for r in self.ropes if r.kind == "longrope"]
        if not longrope or not isinstance(declared, int) or declared <= self.max_position_embeddings:
            return None
        return (f"{self.family}: context capped at {self.max_position_embeddings} tokens (LongRoPE runs with its "
                f"short factors only: past original_max_position_embeddings {min(longrope)} transformers switches "
                f"every position of the sequence to the long factors, which K/V already written to the paged cache "
                f"cannot follow); config max_position_embeddings {declared}")

    def base_shape(self) -> BaseShape:
        return BaseShape(self.num_layers, self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim,
                         self.name, self.family)

    def describe(self) -> str:
        """One line for logs: family, size and the per-layer pieces that differ from plain Llama."""
        parts = [f"{self.family}: {self.num_layers} layers, hidden {self.hidden_size}, heads {self.num_heads}/"
                 f"{self.num_kv_heads}x{self.head_dim}, context {self.max_position_embeddings}"]
        if any(w is not None for w in self.layer_window):
            n = sum(w is not None for w in self.layer_window)
            parts.append(f"sliding window {'/'.join(str(w) for w in self.windows if w)} on {n} of {self.num_layers} layers")
        if len(self.ropes) > 1:
            parts.append(f"{len(self.ropes)} RoPE bases")
        if self.rope_of(0).kind != "default":
            parts.append(f"RoPE {self.rope_of(0).kind}")
        for flag, what in ((self.qkv_bias, "qkv bias"), (self.qk_norm, "q/k norm"), (self.sandwich_norms, "sandwich norms"),
                           (self.tie_word_embeddings, "tied embeddings")):
            if flag:
                parts.append(what)
        if self.activation != "silu":
            parts.append(self.activation)
        return ", ".join(parts)


# --- checkpoint names -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    """A family's tensor names. `layer` is the prefix of layer i's tensors; `modules` maps each projection
    to its module under that prefix (projections that share a module are fused in the checkpoint, stacked by
    rows in PROJECTIONS order); `norms` maps the engine's norm slots to their weights under the prefix."""

    modules: Mapping[str, str]
    norms: Mapping[str, str]
    layer: str  # the prefix of layer i's tensors, with {i}
    embed: str
    final_norm: str
    lm_head: str
    ignore: tuple[str, ...] = ()  # substrings of tensors that are read and dropped

    def module(self, layer: int, proj: str) -> str:
        return self.layer.format(i=layer) + self.modules[proj]

    def fused_parts(self, proj: str) -> tuple[str, ...]:
        """The projections that share `proj`'s checkpoint module, in row order."""
        m = self.modules[proj]
        return tuple(p for p in PROJECTIONS if self.modules.get(p) == m)

    def peft_modules(self) -> dict[str, tuple[str, ...]]:
        """PEFT module name (under the layer prefix) -> the projections a LoRA on it adds to (several when the
        module is fused: B's rows split among them, A shared)."""
        out: dict[str, tuple[str, ...]] = {}
        for p in PROJECTIONS:
            out.setdefault(self.modules[p], self.fused_parts(p))
        return out


@dataclass(frozen=True)
class Gguf:
    """How a family's GGUF files name things: `arch` (general.architecture), layer tensor names
    (`blk.N.<name>` -> checkpoint name under the layer prefix, without `.weight`/`.bias`), global tensors,
    whether q/k rows carry llama.cpp's interleaved-rotary permutation, what the file adds to norm weights
    (`norm_shift`: Gemma's files hold 1 + w), tensors that are not weights (`skip`), and `config(field,
    tensor, cfg)`: the family's own metadata into the HF-style config (field(key, default) reads
    `<arch>.<key>`, tensor(name) a tensor's values or None)."""

    arch: str
    layer: Mapping[str, str]
    globals: Mapping[str, str]
    permute_qk: bool = False
    skip: tuple[str, ...] = ("rope_freqs.weight",)
    norm_shift: float = 0.0
    config: Callable[[Callable, Callable, dict], None] | None = None


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    config: Callable[[dict, str], ModelConfig]
    checkpoint: Checkpoint
    gguf: Gguf | None = None
    notes: str = ""  # what is supported of the family, for --help and refusals


# --- the checkpoint plan: engine parameter <- checkpoint tensors -------------------------------------------


@dataclass(frozen=True)
class Part:
    """Rows [lo, hi) of checkpoint tensor `name` (None: the whole tensor), and the dimension tensor
    parallelism splits it along (None: replicated; a row-parallel bias lives on rank 0 only)."""

    name: str
    rows: tuple[int, int] | None = None
    split: int | None = None
    rank0_only: bool = False


@dataclass(frozen=True)
class Param:
    """One engine parameter, e.g. `layers.3.qkv`, stacked by rows from its parts."""

    name: str
    parts: tuple[Part, ...]
    required: bool = True


def checkpoint_plan(family: Family, cfg: ModelConfig) -> list[Param]:
    """Every engine parameter of a model and where its rows come from in the checkpoint."""
    ck = family.checkpoint
    out = [Param("embed", (Part(ck.embed),)), Param("final_norm", (Part(ck.final_norm),)),
           Param("lm_head", (Part(ck.lm_head),), required=not cfg.tie_word_embeddings)]
    base = cfg.base_shape()
    bias = {"qkv": cfg.qkv_bias, "o": cfg.o_bias, "gate_up": cfg.mlp_bias, "down": cfg.mlp_bias}
    norms_needed = {"attn_norm": True, "mlp_norm": True, "post_attn_norm": cfg.sandwich_norms,
                    "post_mlp_norm": cfg.sandwich_norms, "q_norm": cfg.qk_norm, "k_norm": cfg.qk_norm}
    for i in range(cfg.num_layers):
        pre = ck.layer.format(i=i)
        for fused, projs in FUSED.items():
            for kind in ("weight", "bias"):
                parts = []
                for p in projs:
                    siblings = ck.fused_parts(p)
                    lo = sum(base.shape(s)[1] for s in siblings[: siblings.index(p)])
                    rows = (lo, lo + base.shape(p)[1]) if len(siblings) > 1 else None
                    split = SPLIT_DIM[p] if kind == "weight" else (0 if SPLIT_DIM[p] == 0 else None)
                    parts.append(Part(f"{pre}{ck.modules[p]}.{kind}", rows, split,
                                      rank0_only=kind == "bias" and SPLIT_DIM[p] == 1))
                suffix = "" if kind == "weight" else "_bias"
                if kind == "weight" or bias[fused]:
                    out.append(Param(f"layers.{i}.{fused}{suffix}", tuple(parts)))
        for slot in NORMS:
            if norms_needed[slot]:
                out.append(Param(f"layers.{i}.{slot}", (Part(pre + ck.norms[slot]),)))
    return out


def checkpoint_shapes(family: Family, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> its full shape, for a checkpoint of this family and config."""
    base = cfg.base_shape()
    ck = family.checkpoint
    H = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {ck.embed: (cfg.vocab_size, H), ck.final_norm: (H,)}
    if not cfg.tie_word_embeddings:
        shapes[ck.lm_head] = (cfg.vocab_size, H)
    norm_dim = {"attn_norm": H, "mlp_norm": H, "post_attn_norm": H, "post_mlp_norm": H, "q_norm": cfg.head_dim,
                "k_norm": cfg.head_dim}
    for param in checkpoint_plan(family, cfg):
        if not param.name.startswith("layers."):
            continue
        slot = param.name.split(".", 2)[2]
        for part in param.parts:
            if slot in norm_dim:
                shapes[part.name] = (norm_dim[slot],)
                continue
            proj = _proj_of(ck, part.name)
            siblings = ck.fused_parts(proj)
            out_rows = sum(base.shape(s)[1] for s in siblings)
            shapes[part.name] = (out_rows,) if part.name.endswith(".bias") else (out_rows, base.shape(proj)[0])
    return shapes


def _proj_of(ck: Checkpoint, tensor: str) -> str:
    module = tensor.rsplit(".", 1)[0]
    for p in PROJECTIONS:
        if module.endswith("." + ck.modules[p]):
            return p
    raise KeyError(tensor)


# --- helpers for family modules ---------------------------------------------------------------------------


def hf_int(cfg: dict, key: str, default=None, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer setting of config.json (`default` when absent or null): an int, an integral float (64.0) or a
    string of one; ModelConfigError for anything else (64.7 would be silently cut to 64, true read as 1) and
    for a value below `minimum` or above `maximum`."""
    v = cfg.get(key)
    v = default if v is None else v
    if v is None:
        raise ModelConfigError(f"the model's config lacks {key!r}")
    try:
        if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
            raise ValueError(v)
        n = int(v)
    except (TypeError, ValueError, OverflowError):
        raise ModelConfigError(f"the model's config: {key!r} must be an integer, got {v!r}") from None
    if minimum is not None and n < minimum:
        raise ModelConfigError(f"the model's config: {key!r} must be at least {minimum}, got {n}")
    if maximum is not None and n > maximum:
        raise ModelConfigError(f"the model's config: {key!r} must be at most {maximum:,}, got {n:,}")
    return n


def hf_float(cfg: dict, key: str, default: float, minimum: float | None = None) -> float:
    """A finite number setting of config.json (`default` when absent or null), at least `minimum`."""
    v = cfg.get(key)
    v = default if v is None else v
    try:
        if isinstance(v, bool):
            raise ValueError(v)
        x = float(v)
    except (TypeError, ValueError):
        raise ModelConfigError(f"the model's config: {key!r} must be a number, got {v!r}") from None
    if not math.isfinite(x) or (minimum is not None and x < minimum):
        raise ModelConfigError(f"the model's config: {key!r} must be a finite number"
                               f"{'' if minimum is None else f' of at least {minimum:g}'}, got {v!r}")
    return x


def hf_bool(cfg: dict, key: str, default: bool) -> bool:
    """A true/false setting of config.json (`default` when absent or null); ModelConfigError for any other
    value (the string "false" is truthy: read as a flag it would turn the setting on)."""
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ModelConfigError(f"the model's config: {key!r} must be true or false, got {v!r}")
    return v


def eos_ids(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in ids):
        raise ModelConfigError(f"eos_token_id must be an integer or a list of integers, got {eos!r}")
    return tuple(ids)


SUPPORTED_ROPE = ("default", "linear", "llama3", "longrope")  # and freq_factors, from GGUF files


def rope_from_hf(params: dict, head_dim: int, max_position_embeddings: int, default_theta: float = 10000.0,
                 partial_rotary_factor: float = 1.0, original_max: int | None = None) -> RopeSpec:
    """A RopeSpec from one HF rope dict (transformers 5's `rope_parameters`, or 4.x's `rope_scaling` with the
    theta passed in `default_theta`)."""
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "su":
        kind = "longrope"
    if kind not in SUPPORTED_ROPE and kind != "freq_factors":
        raise ModelConfigError(f"RoPE scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE)})")
    try:
        return _rope(params, kind, head_dim, max_position_embeddings, default_theta, partial_rotary_factor, original_max)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ModelConfigError):
            raise
        raise ModelConfigError(f"RoPE scaling {kind!r}: bad or missing parameter ({exc!r})") from None


def _rope_positive(key: str, value) -> float:
    """A RoPE setting that divides or is raised to a power (theta, the scaling factors): a finite positive number.
    Zero or NaN loaded fine and then made every request's output non-finite."""
    x = float(value)
    if not math.isfinite(x) or x <= 0:
        raise ModelConfigError(f"RoPE setting {key!r} must be a finite positive number, got {value!r}")
    return x


def _rope(params: dict, kind: str, head_dim: int, max_position_embeddings: int, default_theta: float,
          partial_rotary_factor: float, original_max) -> RopeSpec:
    theta = _rope_positive("rope_theta", params.get("rope_theta", default_theta))
    prf = float(params.get("partial_rotary_factor", partial_rotary_factor))
    rotary_dim = int(head_dim * prf)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ModelConfigError(f"partial_rotary_factor {prf} gives a rotary dimension of {rotary_dim} for heads of {head_dim}")
    spec = RopeSpec(theta=theta, rotary_dim=rotary_dim, kind=kind)
    if kind == "linear":
        return dataclasses.replace(spec, factor=_rope_positive("factor", params["factor"]))
    if kind == "llama3":
        return dataclasses.replace(
            spec, factor=_rope_positive("factor", params["factor"]),
            low_freq_factor=_rope_positive("low_freq_factor", params.get("low_freq_factor", 1.0)),
            high_freq_factor=_rope_positive("high_freq_factor", params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)))
    if kind == "freq_factors":
        ext = tuple(float(f) for f in params["ext_factors"])
        if len(ext) != rotary_dim // 2:
            raise ModelConfigError(f"{len(ext)} RoPE frequency factors for a rotary dimension of {rotary_dim}")
        return dataclasses.replace(spec, ext_factors=ext)
    if kind == "longrope":
        omax = params.get("original_max_position_embeddings") or original_max
        if omax is None:
            raise ModelConfigError("longrope scaling needs original_max_position_embeddings")
        omax = int(omax)
        short = tuple(float(f) for f in params.get("short_factor") or ())
        if len(short) != rotary_dim // 2:
            raise ModelConfigError(f"longrope short_factor has {len(short)} entries; the rotary dimension "
                                   f"{rotary_dim} needs {rotary_dim // 2}")
        factor = params.get("factor")
        factor = _rope_positive("factor", factor) if factor is not None else max_position_embeddings / omax
        att = params.get("attention_factor")
        if att is None:
            import math

            att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(omax))
        return dataclasses.replace(spec, factor=factor, original_max_position_embeddings=omax, ext_factors=short,
                                   attention_factor=float(att))
    return spec


def layer_types(cfg: dict, num_layers: int) -> list[str] | None:
    """transformers' `layer_types` ("sliding_attention" / "full_attention" per layer), when config.json has it."""
    lt = cfg.get("layer_types")
    if lt is None:
        return None
    if not isinstance(lt, list) or len(lt) != num_layers:
        raise ModelConfigError(f"layer_types must list {num_layers} entries")
    bad = sorted({t for t in lt if t not in ("sliding_attention", "full_attention")})
    if bad:
        raise ModelConfigError(f"layer_types {bad} are not supported (sliding_attention, full_attention)")
    return lt


# The per-layer tables of a config are built before any weight is read: a layer count of 10**9 took minutes and
# gigabytes to be refused (the weights lack its layers). Released models have up to ~130 layers.
MAX_LAYERS = 4096


def common_fields(cfg: dict, family: str, name: str, head_dim: int | None = None) -> dict:
    """The fields every HF decoder config spells alike (`head_dim`: the family's default when the config has
    none; else hidden / heads)."""
    hidden = hf_int(cfg, "hidden_size", minimum=1)
    heads = hf_int(cfg, "num_attention_heads", minimum=1)
    kv_heads = hf_int(cfg, "num_key_value_heads", heads, minimum=1)
    if heads % kv_heads:
        raise ModelConfigError(f"the model's config: num_attention_heads {heads} is not a multiple of "
                               f"num_key_value_heads {kv_heads}")
    head_dim = hf_int(cfg, "head_dim", head_dim or hidden // heads, minimum=1)
    return dict(
        family=family,
        vocab_size=hf_int(cfg, "vocab_size", minimum=1),
        hidden_size=hidden,
        intermediate_size=hf_int(cfg, "intermediate_size", minimum=1),
        num_layers=hf_int(cfg, "num_hidden_layers", minimum=1, maximum=MAX_LAYERS),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=hf_float(cfg, "rms_norm_eps", 1e-6, minimum=0.0),
        max_position_embeddings=hf_int(cfg, "max_position_embeddings", 4096, minimum=1),
        tie_word_embeddings=hf_bool(cfg, "tie_word_embeddings", False),
        bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
        eos_token_ids=eos_ids(cfg),
        name=name or str(cfg.get("_name_or_path") or ""),
    )


def check_activation(cfg: dict, allowed: tuple[str, ...], key: str = "hidden_act") -> str:
    act = cfg.get(key) or allowed[0]
    if act not in allowed:
        raise ModelConfigError(f"{key} {act!r} is not supported for this family (supported: {', '.join(allowed)})")
    return act

