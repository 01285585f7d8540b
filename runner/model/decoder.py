"""The decoder of every supported family over one flat token batch, and the one layer loop that eager
steps, decode CUDA graphs and piecewise graphs all drive.

A step's tensors live in a `StepIO`: the flat batch `[T, hidden]` (prefill rows of several requests, then
decode rows), its positions and KV slots, and the buffers that cross attention (residual, q, o). The loop

    piece(0)                         embedding, layer 0 up to attention
    for i in layers:
        attention(i)                 q over the paged cache (K/V written by the piece before)
        piece(i + 1)                 layer i after attention, layer i + 1 up to it (the last: the logits)

is `Decoder.forward`; eager steps call the pieces, piecewise graphs replay one captured graph per piece,
decode graphs capture the whole loop. A piece is generic over the family's `ModelConfig`: the norm kind
and placement, activation, biases, q/k norms, embedding scale, RoPE and window per layer, soft-caps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from lorafleet.models.contract import ModelConfig
from lorafleet.runner.config import KernelChoices
from lorafleet.runner.model.fp8 import (E4M3, SM90_MAX_ROWS, SM90_SHRINK_MAX_K, Fp8Weight, bf16_sm90_applies,
                                       bf16_sm90_linear, bf16_sm90_shrink_first, epilogue_applies, fp8_linear,
                                       fp8_shrink_first_applies, fp8_tensor_cores, quantize_tokens,
                                       sm90_gemm_available, unit_scale)
from lorafleet.runner.model.norm import OwnNorm
from lorafleet.runner.model.ops import make_ops, prefer_cublaslt
from lorafleet.runner.model.rope import Rope
from lorafleet.runner.model.weights import PROJECTION_PARAMS

# Group indices for LoraStep.add: projections that share an input run as one SGMV launch.
QKV, O, GATE_UP, DOWN = 0, 1, 2, 3
GROUPS = 4  # projection groups of a layer
# The FP8 epilogue's activation codes (csrc/quant.h Fp8EpilogueArgs::act) per ModelConfig.activation.
ACT_CODES = {"silu": 1, "gelu_tanh": 2}

log = logging.getLogger(__name__)


def plain_projection_elems(lw) -> int:
    """Elements of a layer's projection weights (qkv, o, gate_up, down) on this rank, 0 where they are FP8: the work
    measure of LoRA's dense path (runner/lora/step.py dense_lora_bounds), which FP8 weights never take."""
    if isinstance(lw.qkv, Fp8Weight):
        return 0
    return sum(getattr(lw, name).shape[0] * getattr(lw, name).shape[1] for name in PROJECTION_PARAMS)


def quant_buffers(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty e4m3 rows and fp32 scales [T, 1] for x [T, K]'s per-token quantization by a launch that also does
    other work (the norm's, the LoRA shrink's)."""
    return (torch.empty(x.shape, dtype=E4M3, device=x.device),
            torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device))


def _sm90_taken(ext, device: torch.device, products: str, on: str, off: str) -> bool:
    """Whether the extension `ext` has the wgmma kernel and `device` runs it, logged as where `products` (FP8, bf16)
    of decode-sized steps run: `on` it, or `off` (louder on a 9.0 GPU whose kernel build lacks it: its gain is lost)."""
    taken = sm90_gemm_available(ext, device)
    hopper = torch.cuda.get_device_capability(device) == (9, 0)
    (log.warning if hopper and not taken else log.info)(
        "%s products of decode-sized steps on %s", products, on if taken else f"{off} (the wgmma kernel needs "
        "compute capability 9.0 and a kernel build that found CUTLASS's headers in flashinfer's package)")
    return taken


class AttentionStep(Protocol):
    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq, D] over the paged cache (this step's K/V already written) -> out [T, Hq * D]
        (written into `out` when given)."""


class LoraStep(Protocol):
    def add(self, layer: int, group: int, x: torch.Tensor, ys: tuple[torch.Tensor, ...]) -> None:
        """ys[g] += LoRA add-on of x for projection g of the group, per segment."""

    def add_qkv(self, layer: int, x: torch.Tensor, ys: tuple[torch.Tensor, ...]):
        """The qkv group: adds it (returns None), or leaves the expand to the K/V writer (returns its operands)."""

    # optional: begin(layer, group, x), called right before the group's base product on x, starts LoRA work that
    # may run beside it (LoraStepImpl: on a second stream in decode graphs); the group's add / add_qkv finishes it

    # not None: the step's LoRA is written before the base products (dense_linear), not added after them
    dense: list[tuple[int, int, int]] | None

    def dense_linear(self, layer: int, group: int, x: torch.Tensor, w: torch.Tensor,
                     bias: torch.Tensor | None, out_spare: int = 0) -> torch.Tensor:
        """x @ w.T + bias with the group's LoRA add-on, one output written once (`out_spare`: spare columns
        beside it, for the next projection's K-extended operand)."""


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [q_dim + 2 * kv_dim, H] (or an Fp8Weight, as o, gate_up and down)
    o: torch.Tensor  # [H, q_dim]
    mlp_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 * I, H]
    down: torch.Tensor  # [H, I]
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [D]
    k_norm: torch.Tensor | None = None  # [D]
    post_attn_norm: torch.Tensor | None = None  # [H] (sandwich norms)
    post_mlp_norm: torch.Tensor | None = None  # [H]


@dataclass
class StepIO:
    """One step's tensors as the pieces read and write them. `static`: fixed buffers (CUDA graphs; the
    pieces write into them); otherwise the pieces replace `q`, `o`, `residual` and `logits`."""

    input_ids: torch.Tensor  # int64 [Tp]
    positions: torch.Tensor  # int64 [Tp]
    slots: torch.Tensor  # int64 [Tp] KV slot per row (padded rows: the scratch page)
    logit_rows: torch.Tensor  # int64 [B] rows whose next-token logits are wanted
    residual: torch.Tensor | None = None  # [Tp, H]
    q: torch.Tensor | None = None  # [Tp, q_dim]
    o: torch.Tensor | None = None  # [Tp, q_dim]
    logits: torch.Tensor | None = None  # fp32 [B, V]
    rows: int = 0  # rows attention runs over (fewer than Tp when the pieces are padded)
    static: bool = False
    cos_sin: list | None = None  # per RoPE (torch ops), from the first piece
    # eager steps only: more rows whose logits are wanted, computed apart from `logits` (an lm_head product of
    # its own, so the logit rows' values do not depend on them)
    extra_rows: torch.Tensor | None = None  # int64 [R]
    extra_logits: torch.Tensor | None = None  # fp32 [R, V]

    @classmethod
    def buffers(cls, cfg: ModelConfig, T: int, B: int, dtype, device) -> "StepIO":
        """Static buffers for T rows and B logit rows."""
        i64 = dict(dtype=torch.int64, device=device)
        return cls(torch.zeros(T, **i64), torch.zeros(T, **i64), torch.zeros(T, **i64), torch.zeros(B, **i64),
                   residual=torch.zeros(T, cfg.hidden_size, dtype=dtype, device=device),
                   q=torch.zeros(T, cfg.q_dim, dtype=dtype, device=device),
                   o=torch.zeros(T, cfg.q_dim, dtype=dtype, device=device),
                   logits=torch.zeros(B, cfg.vocab_size, dtype=torch.float32, device=device), rows=T, static=True)

    def view(self, T: int, B: int | None = None) -> "StepIO":
        """The first T rows (and B logit rows) of static buffers."""
        B = self.logit_rows.shape[0] if B is None else B
        return StepIO(self.input_ids[:T], self.positions[:T], self.slots[:T], self.logit_rows[:B],
                      self.residual[:T], self.q[:T], self.o[:T], self.logits[:B], T, True)


class Decoder:
    """With tensor parallelism, `cfg` is this rank's part (its heads, KV heads and MLP width; see
    runner/parallel/shard.py), `params` yield this rank's slices, `full_cfg` is the whole model and
    `all_reduce(t)` sums a tensor over the group in place (after the o and down projections).
    `params` is a weights.Params (engine parameter names, read on demand)."""

    def __init__(self, cfg: ModelConfig, params, dtype: torch.dtype, device: torch.device,
                 kernels: KernelChoices | None = None, full_cfg: ModelConfig | None = None, all_reduce=None,
                 max_positions: int | None = None):
        from lorafleet.runner.model.weights import WeightsError

        kernels = kernels or KernelChoices()
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.full_cfg = full_cfg or cfg
        self.all_reduce = all_reduce
        self.max_positions = min(max_positions or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.ropes = [Rope(spec, self.device) for spec in cfg.ropes]
        self.ops = make_ops(cfg, self.ropes, self.device, self.max_positions, kernels.fused_ops)
        # Steps of at most this many rows run the o and down GEMMs on cuBLASLt (measured on the H200 for
        # one-GPU shapes, so not with tensor parallelism).
        self.lt_rows = kernels.blas_lt_rows if self.device.type == "cuda" and all_reduce is None else 0
        # FP8 projection weights (runner/model/fp8.py): products on FP8 tensor cores where the GPU has them
        self.fp8_tensor_cores = fp8_tensor_cores(self.device)
        self.fp8_ext = None  # the CUDA extension whose kernel quantizes activations (set below, with FP8 weights)
        self.fp8_swap_rows = kernels.fp8_swap_rows
        self.fp8_gemm_rows = kernels.fp8_gemm_rows
        self.fp8_gemm_bf16 = kernels.fp8_gemm_bf16
        self.fp8_unit_scale_elems = kernels.fp8_unit_scale_elems
        self.fp8_epilogue = kernels.fp8_epilogue
        self.fp8_epilogue_act = kernels.fp8_epilogue_act  # ... and for gate_up the activation too (flashinfer ops)
        self.epilogue_early = kernels.epilogue_early  # ... letting the next kernel start at once
        self.fp8_quant_in_shrink = kernels.fp8_quant_in_shrink  # with LoRA, the shrink's launch quantizes them too
        self.fp8_sm90 = False  # the unit-scale product on the project's wgmma kernel (set below, where built)
        self.fp8_sm90_fused = kernels.fp8_sm90_fused  # ... with the epilogue inside it (one part, no activation)
        self.fp8_sm90_split = kernels.fp8_sm90_split  # ... with K in parts for weights of few rows
        self.fp8_sm90_persistent = kernels.fp8_sm90_persistent  # ... on the persistent ping-pong schedule
        # bf16 weights: decode-sized products on that wgmma kernel, bias and LoRA expand inside (set below, where built)
        self.bf16_sm90 = False
        self.sm90_ext = None
        self.unit_scales = None  # ones (fp32) for that kernel's epilogue, made before any graph capture
        # with the rows' LoRA shrink inside its launch too (KernelChoices.sm90_shrink, set below where taken; with FP8
        # weights KernelChoices.fp8_sm90_shrink): that kernel's counters, int32 [layers * GROUPS, 4] zeros, one row per
        # layer and projection group; else None
        self.sm90_sync = None
        self.norm_early = False  # the project's norm before them, letting them start at once (KernelChoices.norm_early)
        # ... the shrink inside them on the producer warp group's idle warps, beside the main loop (bf16 products;
        # FP8 products with fp8_sm90_shrink: fp8_sm90_shrink_producer)
        self.sm90_shrink_producer = kernels.sm90_shrink_producer
        # (or, sm90_shrink_first, every bf16 product with A pools in two launches: the product into fp32 with the
        # shrink on those warps, then the FP8 epilogue's launch)
        self.sm90_shrink_first = kernels.sm90_shrink_first
        self.fp8_sm90_shrink_producer = kernels.fp8_sm90_shrink_producer
        # runner/model/norm.py OwnNorm: the norms before qkv and gate_up (KernelChoices.norm_shrink, norm_quant,
        # norm_early)
        self.own_norm = None
        self.own_norm_quant = True  # ... which writes the rows' e4m3 copy for an FP8 product (False: the product's
        # own quantization does, from the same rows: the same bits, a launch more; tests compare the two)
        self.embed_scale = (torch.tensor(cfg.embed_scale, dtype=torch.float32).to(dtype).item()
                            if cfg.embed_scale is not None else None)
        self.num_layers = cfg.num_layers

        def take(name: str) -> torch.Tensor | None:
            return params.pop(name) if name in params.plan else None

        self.embed = take("embed")  # [V, H]
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            self.layers.append(LayerWeights(**{f: take(p + f) for f in (
                "attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down", "qkv_bias", "o_bias", "gate_up_bias",
                "down_bias", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")}))
        self.final_norm = take("final_norm")
        lm_head = take("lm_head")
        self.lm_head = self.embed if lm_head is None else lm_head  # [V, H]
        leftover = params.unexpected()
        params.close()
        if leftover:
            raise WeightsError(f"unexpected tensors in the weights of a {cfg.family} model, e.g. {leftover[:3]}")
        self._check_shapes(WeightsError)
        self.kv_write = None  # set by attach_kv
        if self.fp8_tensor_cores and isinstance(self.layers[0].qkv, Fp8Weight):
            unit_scale(self.device)  # made before any graph capture reads it
            try:
                from lorafleet.runner.kernels import load

                self.fp8_ext = load()
            except Exception as exc:  # no compiler: torch's ops quantize the activations (same bits, more launches)
                log.warning("FP8 activation kernel unavailable (%s); activations are quantized by torch ops", exc)
            if kernels.fp8_sm90:
                self.fp8_sm90 = _sm90_taken(self.fp8_ext, self.device, "FP8",
                                            "the wgmma kernel (csrc/fp8_gemm_sm90.cu)", "cuBLASLt")
            if kernels.fp8_sm90_shrink and self.fp8_sm90 and dtype == torch.bfloat16:
                # (the shrink first: one counter row per layer and projection group, as sm90_shrink's)
                self.sm90_sync = torch.zeros(len(self.layers) * GROUPS, 4, dtype=torch.int32, device=self.device)
            elif kernels.fp8_sm90_shrink:  # (on by default: said at debug level)
                log.debug("fp8_sm90_shrink ignored: it needs the FP8 products on the wgmma kernel and bfloat16 rows")
        if kernels.bf16_sm90:
            weights = "FP8" if isinstance(self.layers[0].qkv, Fp8Weight) else str(dtype).replace("torch.", "")
            if self.device.type == "cuda" and weights == "bfloat16":
                self._take_bf16_sm90(kernels.sm90_shrink)
            else:  # (on by default: nothing to say where it cannot apply)
                log.debug("bf16_sm90 ignored: it takes bfloat16 weights on a CUDA device, not %s weights on %s",
                          weights, self.device.type)
        for choice in ("sm90_shrink", "norm_early"):  # (both on by default: nothing to say where they cannot apply)
            if getattr(kernels, choice) and not self.bf16_sm90:
                log.debug("%s ignored: it applies to the bf16 products on the wgmma kernel, which this model does not "
                          "take (bf16_sm90 off, or not bfloat16 weights on a compute capability 9.0 GPU)", choice)
        # (norm_quant only where the norm's launch quantizes the rows: FP8 products on the FP8 tensor cores)
        norm_quant = kernels.norm_quant and self.fp8_tensor_cores and isinstance(self.layers[0].qkv, Fp8Weight)
        # (norm_early only before the wgmma products, which wait for the norm before they read its rows)
        self.norm_early = kernels.norm_early and self.bf16_sm90
        if ((kernels.norm_shrink or norm_quant or self.norm_early) and self.device.type == "cuda"
                and dtype in (torch.bfloat16, torch.float16)):
            try:
                from lorafleet.runner.kernels import load

                self.own_norm = OwnNorm(load(), cfg.rms_norm_eps, cfg.norm_offset)
            except Exception as exc:  # no compiler: the ops' norms and the separate shrink launches
                log.warning("norm kernel unavailable (%s); the norms take %s's kernels", exc, self.ops.name)
        if (self.sm90_sync is not None and not self.bf16_sm90 and not self.fp8_sm90_shrink_producer
                and (self.own_norm is None or not norm_quant)):
            log.info("fp8_sm90_shrink takes the products whose rows the norm quantizes (LORAFLEET_NORM_QUANT): "
                     "none here")

    def _take_bf16_sm90(self, shrink: bool) -> None:
        """KernelChoices.bf16_sm90: the wgmma kernel for this model's decode-sized bf16 products, where the build has
        it and the GPU runs it (logged either way); `shrink`: KernelChoices.sm90_shrink."""
        try:
            from lorafleet.runner.kernels import load

            ext = load()
        except Exception as exc:  # no compiler: cuBLAS's products
            log.warning("bf16 products stay on cuBLAS: the kernel build is unavailable (%s)", exc)
            return
        self.bf16_sm90 = _sm90_taken(ext, self.device, "bf16", "the wgmma kernel, LoRA's expand in its epilogue",
                                     "cuBLAS")
        if self.bf16_sm90:
            self.sm90_ext = ext
            rows = max([getattr(self.layers[0], name).shape[0] for name in PROJECTION_PARAMS] + [self.lm_head.shape[0]])
            self.unit_scales = torch.ones(max(rows, SM90_MAX_ROWS), dtype=torch.float32, device=self.device)
            if shrink:
                self.sm90_sync = torch.zeros(len(self.layers) * GROUPS, 4, dtype=torch.int32, device=self.device)

    def widen_for_lora(self, spare: dict[str, int]) -> int:
        """Gives the plain (not FP8) weights named in `spare` (qkv, gate_up) that many spare columns: each becomes
        the [:, :K] view of a zeroed [N, K + c] tensor, which every product reads as before (a row stride of K + c),
        and LoRA's dense path fills the spare columns with a step's B^T (runner/lora/step.py, the K-extended GEMM).
        qkv and gate_up because their inputs are normalized in place inside the previous projection's output, which
        then carries the spare columns of x too (_spare_for); not where a sandwich norm writes that input into a new
        tensor (post_mlp_norm before qkv, post_attn_norm before gate_up). o's and down's inputs (attention's output,
        the activation's) would need a copy of x, which costs more than the add-on's write it saves. Returns the
        bytes added."""
        post = {"qkv": "post_mlp_norm", "gate_up": "post_attn_norm"}
        added = 0
        for lw in self.layers:
            for name, c in spare.items():
                w = getattr(lw, name)
                if (isinstance(w, Fp8Weight) or c <= 0 or w.stride(0) > w.shape[1]
                        or getattr(lw, post[name]) is not None):
                    continue
                n, k = w.shape
                wide = torch.zeros(n, k + c, dtype=w.dtype, device=w.device)
                wide[:, :k].copy_(w)
                setattr(lw, name, wide[:, :k])
                added += n * c * w.element_size()
        return added

    def spare_columns(self, layer: int, group: int) -> int:
        """Spare columns of layer's `group` weight (widen_for_lora), 0 for none or past the last layer."""
        if not 0 <= layer < self.num_layers:
            return 0
        w = getattr(self.layers[layer], PROJECTION_PARAMS[group])
        return 0 if isinstance(w, Fp8Weight) else w.stride(0) - w.shape[1]

    def _check_shapes(self, error) -> None:
        c = self.cfg
        l0 = self.layers[0]
        want = {
            "embed": (self.embed, (c.vocab_size, c.hidden_size)),
            "lm_head": (self.lm_head, (c.vocab_size, c.hidden_size)),
            "qkv": (l0.qkv, (c.q_dim + 2 * c.kv_dim, c.hidden_size)),
            "o": (l0.o, (c.hidden_size, c.q_dim)),
            "gate_up": (l0.gate_up, (2 * c.intermediate_size, c.hidden_size)),
            "down": (l0.down, (c.hidden_size, c.intermediate_size)),
        }
        if l0.q_norm is not None:
            want["q_norm"] = (l0.q_norm, (c.head_dim,))
        for name, (t, shape) in want.items():
            if tuple(t.shape) != shape:
                raise error(f"{name} has shape {tuple(t.shape)}, config.json implies {shape}")

    def attach_kv(self, writer) -> None:
        """The K/V writer (runner/model/rope_kv.py): `writer(layer, qkv, io, expand) -> q`, rotating q and k
        and writing k, v into the layer's pages at `io.slots`."""
        self.kv_write = writer

    # -- the pieces ---------------------------------------------------------------------------------------
    def embed_tokens(self, io: StepIO) -> torch.Tensor:
        if io.static:
            h = torch.index_select(self.embed, 0, io.input_ids, out=io.residual)
            if self.embed_scale is not None:
                h.mul_(self.embed_scale)
            return h
        h = F.embedding(io.input_ids, self.embed)  # [T, H]
        if self.embed_scale is not None:
            h = h * self.embed_scale
        io.residual = h
        return h

    def pre_attention(self, i: int, h: torch.Tensor, residual: torch.Tensor | None, io: StepIO,
                      lora: LoraStep | None) -> torch.Tensor:
        """Layer i up to attention: norm, qkv projection and its LoRA, q/k norms, then the K/V writer (RoPE,
        k and v into the cache, rotated q into io.q). Returns the residual."""
        c, ops, lw = self.cfg, self.ops, self.layers[i]
        # (static buffers: the new residual goes back into io.residual, so the piece needs no copy)
        x, residual, quant = self._norm(i, QKV, h, residual, lw.attn_norm, lora, lw.qkv,
                                        io.residual if io.static else None)
        expand = None
        if self._dense(lora, lw.qkv):
            qkv = lora.dense_linear(i, QKV, x, lw.qkv, lw.qkv_bias)
        else:
            spans = [c.q_dim, c.kv_dim, c.kv_dim]
            qkv = self._finished(i, QKV, x, lw.qkv, lw.qkv_bias, lora, spans, quant)
            if qkv is None:
                self._begin(lora, i, QKV, x)
                qkv = self._linear(x, lw.qkv, lw.qkv_bias, quant)  # [T, q_dim + 2 kv_dim]
                if lora is not None:
                    expand = lora.add_qkv(i, x, qkv.split(spans, dim=-1))
        if lw.q_norm is not None:
            T = qkv.shape[0]
            q, k = qkv[:, : c.q_dim].view(T, c.num_heads, c.head_dim), qkv[:, c.q_dim: c.q_dim + c.kv_dim].view(
                T, c.num_kv_heads, c.head_dim)
            q.copy_(ops.head_norm(q, lw.q_norm))
            k.copy_(ops.head_norm(k, lw.k_norm))
        q = self.kv_write(i, qkv, io, expand)
        if not io.static:
            io.q = q
        return residual

    def post_attention(self, i: int, o: torch.Tensor, residual: torch.Tensor, lora: LoraStep | None):
        """Layer i after attention: o-proj and its LoRA, [norm], add + norm, MLP and its LoRA, [norm]."""
        c, ops, lw = self.cfg, self.ops, self.layers[i]
        # on LoRA's dense path, o's output in a buffer with room for gate_up's K-extended operand (see _spare_for)
        out = self._project(i, O, o, lw.o, lw.o_bias, lora, small=True,
                            out_spare=self._spare_for(lora, i, GATE_UP, lw.post_attn_norm))  # [T, H]
        if self.all_reduce is not None:
            self.all_reduce(out)
        if lw.post_attn_norm is not None:
            out = ops.rms_norm(out, lw.post_attn_norm)
        x, residual, quant = self._norm(i, GATE_UP, out, residual, lw.mlp_norm, lora, lw.gate_up)
        a = None
        if self.fp8_epilogue_act and ops.name == "flashinfer" and not self._dense(lora, lw.gate_up):
            # the FP8 epilogue of gate_up writes act(gate) * up itself, flashinfer's act_and_mul bits (None: not here)
            a = self._finished(i, GATE_UP, x, lw.gate_up, lw.gate_up_bias, lora,
                               [c.intermediate_size, c.intermediate_size], quant, act=ACT_CODES[c.activation])
        if a is None:
            gu = self._project(i, GATE_UP, x, lw.gate_up, lw.gate_up_bias, lora,
                               split=[c.intermediate_size, c.intermediate_size], quant=quant)  # [T, 2 I]
            a = ops.act_mul(gu, c.intermediate_size)  # [T, I]
        h = self._project(i, DOWN, a, lw.down, lw.down_bias, lora, small=True,
                          out_spare=self._spare_for(lora, i + 1, QKV, lw.post_mlp_norm))
        # [T, H] (partial sum with TP)
        if self.all_reduce is not None:
            self.all_reduce(h)
        if lw.post_mlp_norm is not None:
            h = ops.rms_norm(h, lw.post_mlp_norm)
        return h, residual

    def _norm(self, i: int, group: int, h: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor,
              lora: LoraStep | None, proj, res_dst: torch.Tensor | None = None):
        """The RMSNorm before layer i's `group` (qkv or gate_up) of h (+ residual) -> (x, the residual, quant).
        On the project's kernel where it applies (self.own_norm): the new residual into `res_dst` (else a new
        tensor), with an FP8 projection `proj` x's e4m3 rows and scales [T, 1] as quant (else None), and in decode
        graphs with adapters the group's shrink in the same launch (LoraStepImpl.norm_shrink). Otherwise the ops'
        norm (flashinfer's, in place)."""
        own = self.own_norm
        if own is None or not own.applies(h, w) or (residual is not None and (residual.shape != h.shape
                                                                             or not own.applies(residual, w))):
            if residual is None:
                return self.ops.rms_norm(h, w), h, None
            x, residual = self.ops.add_rms_norm(h, residual, w)
            return x, residual, None
        n = own.operands(h, residual, w, res_dst)
        x = torch.empty_like(h)
        quant = None
        # (also under fp8_gemm_bf16: the product then ignores them where its bf16-row kernel runs, and every other
        # FP8 call, which the step may still take, needs them: the norm's launch may have done the shrink already)
        if isinstance(proj, Fp8Weight) and self.fp8_tensor_cores and self.own_norm_quant:
            quant = quant_buffers(h)
        q = quant and (quant[0], quant[1].view(-1))
        if not (lora is not None and getattr(lora, "norm_shrink", None) is not None
                and lora.norm_shrink(i, group, x, n, q)):
            own.run(x, n, q, early=self.norm_early)
        return x, (h if residual is None else n.res_out), quant

    def _spare_for(self, lora: LoraStep | None, layer: int, group: int, post_norm) -> int:
        """Spare columns for an output on LoRA's dense path that becomes, normalized in place (the ops' add + norm
        writes into it), the input of layer's `group`: that weight's spare columns (Decoder.widen_for_lora), which
        its K-extended GEMM fills beside x; 0 where the output is reduced across ranks (the reduction takes
        contiguous tensors) or normalized into a new tensor first (sandwich norms)."""
        if (lora is None or getattr(lora, "dense", None) is None or self.all_reduce is not None
                or post_norm is not None):
            return 0
        return self.spare_columns(layer, group)

    def _project(self, i: int, group: int, x: torch.Tensor, w, b: torch.Tensor | None, lora: LoraStep | None,
                 small: bool = False, split: list[int] | None = None, quant=None,
                 out_spare: int = 0) -> torch.Tensor:
        """x @ w.T + b with layer i's LoRA of `group` (o, gate_up or down): on the dense path (`out_spare`: see
        LoraStepImpl.dense_linear), or the base product (`_linear_small` for `small`) then the add-on into its
        projections' columns (`split`). `quant`: x's e4m3 rows and scales, made by the norm's launch (FP8 weights)."""
        if self._dense(lora, w):
            return lora.dense_linear(i, group, x, w, b, out_spare=out_spare)
        y = self._finished(i, group, x, w, b, lora, split or [w.shape[0]], quant)
        if y is not None:
            return y
        self._begin(lora, i, group, x)
        y = self._linear(x, w, b, quant) if not small else self._linear_small(x, w, b)
        if lora is not None:
            lora.add(i, group, x, tuple(y.split(split, dim=-1)) if split else (y,))
        return y

    def _finished(self, i: int, group: int, x: torch.Tensor, w, b: torch.Tensor | None, lora: LoraStep | None,
                  spans: list[int], quantized=None, act: int = 0) -> torch.Tensor | None:
        """x @ w.T + b with layer i's LoRA of `group` in a product whose epilogue applies the bias and the expand in
        the same launch as the scales, after the group's shrink (runner/model/fp8.py): an FP8 weight whose unit-scale
        product the epilogue kernel finishes, or with bf16_sm90 a bf16 weight on the wgmma kernel; else None (the
        caller takes the separate launches; nothing was launched). `act` (gate_up; FP8, or bf16 with
        sm90_shrink_first in steps with adapters): the epilogue also applies the activation (fp8_linear,
        bf16_sm90_shrink_first) and returns act(gate) * up."""
        fp8 = isinstance(w, Fp8Weight)
        if fp8:
            if not (self.fp8_epilogue and epilogue_applies(x, w, b, self.fp8_tensor_cores, self.fp8_ext,
                                                           self.fp8_gemm_rows, self.fp8_unit_scale_elems, spans)):
                return None
        elif not (self.bf16_sm90 and bf16_sm90_applies(x, w, b, spans)) or (act and not (
                self.sm90_shrink_first and self.sm90_sync is not None and getattr(lora, "active", False))):
            return None  # (an activation: only in the two launches' epilogue, and only in steps with adapters)
        if lora is not None and not getattr(lora, "epilogue_ready", False):
            return None
        if not fp8:
            # (the shrink inside the product up to SM90_SHRINK_MAX_K where the consumer warps run it before their main
            # loop, a longer K keeps the shrink's launch; any K on the producer's warps beside the main loop)
            # (with sm90_shrink_first: on the producer's warps at any K, the expand in the FP8 epilogue's launch after
            # the product)
            long_k = x.shape[1] > SM90_SHRINK_MAX_K
            first = self.sm90_shrink_first
            producer = first or self.sm90_shrink_producer
            inside = self.sm90_sync is not None and (producer or not long_k)
            sync = self.sm90_sync[i * GROUPS + group] if inside else None
            operands = None if lora is None else lora.epilogue_operands(i, group, x, in_product=inside)
            if first and (act or (inside and operands is not None and operands[4] is not None)):
                return bf16_sm90_shrink_first(self.sm90_ext, x, w, b, spans, operands, self.unit_scales, sync, act=act,
                                              **self._early())
            # (the producer's warps where the product gets A pools: the step's first group does not)
            on_producer = inside and producer and operands is not None and operands[4] is not None
            return bf16_sm90_linear(self.sm90_ext, x, w, b, spans, operands, self.unit_scales, sync,
                                    **({"shrink_producer": True} if on_producer else {}))
        operands, quant, sync = None, quantized, None
        if lora is not None:
            # (the shrink first, on the product's warps: where the norm quantized x, K is at most SM90_SHRINK_MAX_K
            # and the product is the wgmma kernel's unit-scale one, with the FP8 epilogue's launch after it; on the
            # producer's warps, beside the main loop, at any K and also where the norm did not quantize x (o, down):
            # their rows then quantized by the activation kernel's own launch, as in steps without adapters, instead
            # of by the shrink's)
            producer = self.fp8_sm90_shrink_producer
            can = (self.sm90_sync is not None and self.fp8_sm90 and not self.fp8_sm90_split
                   and (producer or x.shape[1] <= SM90_SHRINK_MAX_K)
                   and not self.fp8_sm90_persistent)
            if can and producer and quant is None and x.dtype == torch.bfloat16 and x.is_contiguous():
                quant = quantize_tokens(x, self.fp8_ext)
            first = can and quant is not None and fp8_shrink_first_applies(x, quant[0], w)
            mine = None
            if quant is None and self.fp8_quant_in_shrink and x.is_contiguous():  # the shrink's launch quantizes x too
                quant = mine = quant_buffers(x)
            operands = lora.epilogue_operands(i, group, x, quant=mine and (mine[0], mine[1].view(-1)),
                                              in_product=first)
            if operands is None and mine is not None:  # no adapter in the step: no shrink was launched
                quant = None
            if operands is not None and operands[4] is not None:
                sync = self.sm90_sync[i * GROUPS + group]
        on_producer = {"shrink_producer": True} if sync is not None and self.fp8_sm90_shrink_producer else {}
        return self._fp8_linear(x, w, b, epilogue=True, spans=spans, lora=operands, quantized=quant, act=act,
                                shrink_sync=sync, **on_producer, **self._early())

    def _early(self) -> dict:
        """The epilogue's launch lets the next kernel start at once (KernelChoices.epilogue_early): its argument."""
        return {"early": True} if self.epilogue_early else {}

    def _fp8_linear(self, x: torch.Tensor, w: Fp8Weight, b: torch.Tensor | None, **finish) -> torch.Tensor:
        """fp8_linear with this model's FP8 kernel choices; `finish`: its epilogue arguments."""
        return fp8_linear(x, w, b, self.fp8_tensor_cores, self.fp8_ext, self.fp8_swap_rows, self.fp8_gemm_rows,
                          self.fp8_unit_scale_elems, self.fp8_gemm_bf16, sm90=self.fp8_sm90,
                          sm90_split=self.fp8_sm90_split, sm90_fused=self.fp8_sm90_fused,
                          sm90_persistent=self.fp8_sm90_persistent, **finish)

    @staticmethod
    def _begin(lora: LoraStep | None, layer: int, group: int, x: torch.Tensor) -> None:
        """The step's LoRA work of layer's `group` that may run beside its base product (LoraStep.begin), if any."""
        begin = getattr(lora, "begin", None)
        if begin is not None:
            begin(layer, group, x)

    @staticmethod
    def _dense(lora: LoraStep | None, w) -> bool:
        """The step's LoRA takes the dense path for this weight (runner/lora/step.py: an eager step of long
        segments; a bf16/fp16/fp32 weight, whose product can accumulate onto the add-on)."""
        return lora is not None and getattr(lora, "dense", None) is not None and not isinstance(w, Fp8Weight)

    def _linear(self, x: torch.Tensor, w, b: torch.Tensor | None, quant=None) -> torch.Tensor:
        """x @ w.T + b for a bf16/fp16/fp32 weight or an FP8 one (`quant`: x's e4m3 rows and scales, made)."""
        if isinstance(w, Fp8Weight):
            return self._fp8_linear(x, w, b, quantized=quant)
        return F.linear(x, w, b)

    def _linear_small(self, x: torch.Tensor, w, b: torch.Tensor | None) -> torch.Tensor:
        """x @ w.T + b; on cuBLASLt for steps of at most `lt_rows` rows (the o and down projections)."""
        if isinstance(w, Fp8Weight):
            return self._fp8_linear(x, w, b)
        if 0 < x.shape[0] <= self.lt_rows:
            with prefer_cublaslt():
                return F.linear(x, w, b)
        return F.linear(x, w, b)

    def logits(self, h: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        x, _ = self.ops.add_rms_norm(h.index_select(0, rows), residual.index_select(0, rows), self.final_norm)
        z = self._head(x).float()  # [B, V]
        if self.cfg.final_softcap is not None:
            z = torch.tanh(z / self.cfg.final_softcap) * self.cfg.final_softcap
        return z

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """x @ lm_head.T: on the wgmma kernel where it takes the decode-sized bf16 products (bf16_sm90), whose rows do
        not depend on how many rows the call has, so a decode row's logits do not depend on the step's size (cuBLAS
        picks its kernel by the row count); cuBLAS's product elsewhere."""
        spans = [self.lm_head.shape[0]]
        if self.bf16_sm90 and bf16_sm90_applies(x, self.lm_head, None, spans):
            return bf16_sm90_linear(self.sm90_ext, x, self.lm_head, None, spans, None, self.unit_scales)
        return F.linear(x, self.lm_head)

    def piece(self, j: int, io: StepIO, lora: LoraStep | None) -> None:
        """Piece j of the loop: the embedding (j = 0) or layer j-1 after attention, then layer j up to
        attention, or (j = L) the logits."""
        if j == 0:
            h, residual = self.embed_tokens(io), None
            io.cos_sin = self.ops.rope_cos_sin(io.positions, self.dtype)
        else:
            h, residual = self.post_attention(j - 1, io.o, io.residual, lora)
            if j == self.num_layers:
                z = self.logits(h, residual, io.logit_rows)
                if io.extra_rows is not None:
                    io.extra_logits = self.logits(h, residual, io.extra_rows)
                if io.static:
                    io.logits.copy_(z)
                else:
                    io.logits = z
                return
        residual = self.pre_attention(j, h, residual, io, lora)
        if not io.static:
            io.residual = residual
        elif residual.data_ptr() != io.residual.data_ptr():  # ops that do not update the residual in place
            io.residual.copy_(residual)

    @torch.inference_mode()
    def forward(self, io: StepIO, attn: AttentionStep, lora: LoraStep | None, replay=None) -> torch.Tensor:
        """The layer loop -> logits fp32 [B, V]. `replay(j)` runs piece j (a captured graph); by default the
        pieces run here."""
        run = replay or (lambda j: self.piece(j, io, lora))
        c = self.cfg
        run(0)
        T = io.rows or io.input_ids.shape[0]
        for i in range(self.num_layers):
            q = io.q[:T].view(T, c.num_heads, c.head_dim)
            if io.static:
                attn.attend(i, q, out=io.o[:T])
            else:
                io.o = attn.attend(i, q)
            run(i + 1)
        return io.logits
