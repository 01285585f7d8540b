"""What every tensor-parallel rank builds the same way: its part of the model, the KV cache, the
LoRA pool, attention and SGMV kernels, CUDA graphs, and the ModelRunner that executes step batches.

Rank 0's Engine adds scheduling on top (batcher, pages, adapter manager); ranks 1..G-1 build only
this (runner/parallel/worker.py). Every collective (the KV-size agreement, the all-reduces of graph
warm-ups and captures) happens in the same order on every rank because they all run this code.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from lorafleet.models.contract import DeviceError
from lorafleet.runner.config import EngineConfig, KernelChoices, ModelConfig, ModelConfigError
from lorafleet.runner.executor.kv_cache import KVCache, bytes_per_token
from lorafleet.runner.executor.model_runner import ModelRunner
from lorafleet.runner.lora.pool import GROUP_SPANS, LoraPool
from lorafleet.runner.model.decoder import Decoder, plain_projection_elems
from lorafleet.runner.model.fp8 import E4M3, Fp8Weight, fp8_tensor_cores
from lorafleet.runner.model.rope_kv import make_kv_writer
from lorafleet.runner.model.weights import load_model

log = logging.getLogger(__name__)
DEFAULT_STEP_TOKENS = 2048  # chunked prefill: token rows per step when EngineConfig leaves it open (CUDA)
# On the CPU a step of 2,048 prompt rows takes seconds: smaller chunks let decodes, cancellations and short
# prompts through between the chunks of a long prompt.
CPU_STEP_TOKENS = 512
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"unknown device {name!r} (use auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"--device {name} was asked for but CUDA is not available on this machine (torch "
                          f"{torch.__version__}{'' if torch.version.cuda else ', a build without CUDA'})")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise DeviceError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if dev.type not in ("cpu", "cuda"):
        raise DeviceError(f"device {name!r}: this engine runs on cpu or cuda")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of float32, bfloat16, float16")
    return DTYPES[name]


@dataclass
class Executor:
    model: Decoder
    device: torch.device
    dtype: torch.dtype
    kv: KVCache
    num_pages: int  # usable pages (the KV pool holds one more: the scratch page of padded rows)
    lora_pool: LoraPool | None
    attention: object
    sgmv: object
    runner: ModelRunner
    max_step_tokens: int | None  # chunked prefill budget (None: unchunked)


def step_budget(config: EngineConfig, device: torch.device) -> int | None:
    """Token rows per step (chunked prefill), or None (unchunked: `chunked_prefill=False`)."""
    budget = config.max_step_tokens
    if budget is None and config.chunked_prefill is not False:
        budget = DEFAULT_STEP_TOKENS if device.type == "cuda" else CPU_STEP_TOKENS
    return None if budget is None else max(budget, config.max_batch_size + 1)


def build_executor(model: "str | Decoder", config: EngineConfig, shard=None, group=None,
                   device: torch.device | None = None) -> Executor:
    """`model`: a path (HF directory, .gguf, synthetic directory) or a built Decoder (TP = 1).
    `config.kernels` must be resolved (the engine does it)."""
    kernels = config.kernels or KernelChoices()
    if isinstance(model, Decoder):
        net = model
        device, dtype = model.device, model.dtype
    else:
        device = device or resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        t0 = time.perf_counter()
        loaded = load_model(model, shard, device, dtype, fp8=config.quantization == "fp8")
        full = loaded.config
        cap = full.context_cap_note(loaded.hf_config.get("max_position_embeddings"))
        if cap is not None:
            log.info("%s", cap)
        check_context(config, full)
        check_fp8(loaded.params.fp8, device)
        cfg = shard.config(full) if shard is not None else full
        net = Decoder(cfg, loaded.params, dtype, device, kernels, full_cfg=full,
                      all_reduce=group.all_reduce if group is not None else None,
                      max_positions=config.max_model_len)
        del loaded
        part = f" (tensor-parallel rank {shard.rank} of {shard.size})" if shard is not None and shard.size > 1 else ""
        fp8 = ""
        if net.layers and isinstance(net.layers[0].qkv, Fp8Weight):
            fp8 = (", projection weights in FP8 e4m3 (" + ("products on FP8 tensor cores)" if net.fp8_tensor_cores else
                                                       "weight-only: dequantized for each product)"))
        log.info("loaded %s%s on %s as %s%s in %.1fs: %s", model, part, device, dtype, fp8, time.perf_counter() - t0,
                 full.describe())
    check_context(config, net.full_cfg)
    rank_cfg: ModelConfig = net.cfg
    lora_pool = None
    if config.enable_lora:
        slots = config.lora_slots or (64 if device.type == "cuda" else 8)
        lora_pool = LoraPool(rank_cfg.base_shape(), slots, config.max_lora_rank, dtype, device, shard,
                             net.full_cfg.base_shape())
    budget = step_budget(config, device)
    widen_for_dense_lora(net, lora_pool, kernels, budget)
    kv_dtype = E4M3 if config.kv_cache_dtype == "fp8" else dtype
    num_pages = config.num_pages or default_pages(rank_cfg, kv_dtype, device, config)
    if group is not None:
        num_pages = group.min_int(num_pages)  # every rank must hold the same pages
    # one extra page: the scratch page padded rows of captured CUDA graphs write to
    try:
        kv = KVCache(rank_cfg, num_pages + 1, config.page_size, kv_dtype, device)
    except RuntimeError as exc:  # (torch.OutOfMemoryError too) a size too large to allocate, or to even compute
        raise ModelConfigError(f"the KV cache of {num_pages:,} pages x {config.page_size} tokens cannot be allocated "
                               f"on {device}: {str(exc).splitlines()[0][:200]}; lower --kv-pages, --kv-cache-gb or "
                               "--kv-fraction") from None
    net.attach_kv(make_kv_writer(net, kv.flat, kernels.rope_kv, kernels.rope_kv_fp8, kernels.rope_kv_pdl))
    from lorafleet.runner.executor.attention.select import attention_backend

    attention = attention_backend(kv, rank_cfg, device, kernels, dtype)
    sgmv = make_sgmv(device, dtype, kernels)
    graphs = make_graphs(net, attention, lora_pool, sgmv, config, num_pages)
    mixed = make_piecewise(net, attention, lora_pool, sgmv, config, budget, num_pages) if graphs is not None else None
    runner = ModelRunner(net, attention, lora_pool, sgmv, config.page_size, graphs, mixed, kernels)
    return Executor(net, device, dtype, kv, num_pages, lora_pool, attention, sgmv, runner, budget)


def widen_for_dense_lora(net: Decoder, lora_pool, kernels: KernelChoices, budget: int | None) -> None:
    """Spare columns in the projection weights for LoRA's dense path as one K-extended GEMM
    (KernelChoices.dense_lora_kext), where that path can be taken at all: adapters, plain weights, one rank (the
    outputs that become the next inputs are all-reduced as contiguous tensors under tensor parallelism), and a step's
    rows (the step budget, else the context) times one layer's projection weights reaching its work floor. The
    narrow weights' memory goes back to the device (the KV pages are sized from what is free next)."""
    if (lora_pool is None or kernels.dense_lora_kext <= 0 or kernels.dense_lora_rows <= 0 or not net.layers
            or net.all_reduce is not None):
        return
    elems = plain_projection_elems(net.layers[0])
    if not elems or elems * (budget or net.max_positions) < kernels.dense_lora_min_work:
        return
    k = kernels.dense_lora_kext  # per LoRA projection of the group: q, k, v; gate, up
    added = net.widen_for_lora({"qkv": GROUP_SPANS[0][1] * k, "gate_up": GROUP_SPANS[2][1] * k})
    if added and net.device.type == "cuda":
        torch.cuda.empty_cache()
    if added:
        log.info("LoRA's dense path runs qkv and gate_up as K-extended GEMMs: %d spare columns per LoRA projection in "
                 "their weights, %.1f MB", kernels.dense_lora_kext, added / 2**20)


def check_fp8(fp8: bool, device: torch.device) -> None:
    """FP8 weights run on FP8 tensor cores or, on the CPU, weight-only; a GPU without FP8 tensor cores (an
    A100) is refused rather than dequantizing every weight in every step."""
    if fp8 and device.type == "cuda" and not fp8_tensor_cores(device):
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ModelConfigError(f"FP8 weights need a GPU with FP8 tensor cores (compute capability 8.9 or later); "
                               f"this one is {cap}: serve the bf16 checkpoint instead")


def check_context(config: EngineConfig, cfg: ModelConfig) -> None:
    """A context longer than the model's is refused (RoPE angles past it would be read out of range, or
    from the wrong factors)."""
    if config.max_model_len is not None and config.max_model_len > cfg.max_position_embeddings:
        raise ModelConfigError(f"max_model_len {config.max_model_len} exceeds the model's context of "
                               f"{cfg.max_position_embeddings} tokens")


def default_pages(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, config: EngineConfig) -> int:
    per_token = bytes_per_token(cfg, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * config.kv_fraction
    else:
        budget = config.kv_cache_gb * (1 << 30)
    return max(1, int(budget // (per_token * config.page_size)))


def make_sgmv(device: torch.device, dtype: torch.dtype, kernels: KernelChoices):
    from lorafleet.runner.lora.sgmv import TorchSGMV

    try:
        from lorafleet.runner.lora.sgmv_select import sgmv_backend
    except ImportError:
        return TorchSGMV()
    return sgmv_backend(device, dtype=dtype, choice=kernels.sgmv)


def make_graphs(model, attention, lora_pool, sgmv, config: EngineConfig, scratch_page: int):
    """CUDA graphs for decode steps when every op on that path is capturable."""
    if model.device.type != "cuda" or not config.cuda_graphs:
        return None
    if attention.name != "flashinfer" or (lora_pool is not None and sgmv.name == "torch"):
        log.warning("decode CUDA graphs need flashinfer attention and the CUDA SGMV kernels; running eagerly")
        return None
    from lorafleet.runner.executor.cuda_graph import GraphRunner

    t0 = time.perf_counter()
    g = GraphRunner(model, attention, lora_pool, sgmv, config.page_size, config.max_batch_size, scratch_page,
                    config.kernels or KernelChoices())
    g.capture_all()
    log.info("CUDA graph capture took %.1fs", time.perf_counter() - t0)
    return g


def make_piecewise(model, attention, lora_pool, sgmv, config: EngineConfig, budget: int | None, scratch_page: int):
    """Piecewise CUDA graphs for steps with prefill (everything but attention replayed)."""
    if not config.piecewise_graphs:
        return None
    from lorafleet.runner.executor.piecewise import PiecewiseGraphs, default_buckets

    t0 = time.perf_counter()
    limit = budget or (config.max_prefill_tokens + config.max_batch_size)
    pw = PiecewiseGraphs(model, attention, lora_pool, sgmv, config.max_batch_size, default_buckets(limit),
                         scratch_page * config.page_size, config.kernels or KernelChoices())
    log.info("piecewise graph capture took %.1fs", time.perf_counter() - t0)
    return pw
