"""The engine: requests in, token ids out, one `step()` at a time.

    plan = batcher.schedule()                          # who computes which rows, pages, evictions
    inflight = runner.launch(build_step_batch(plan))   # one flat multi-LoRA batch, queued on the device
                                                       # (batch_invariant: decode and prompt rows as two
                                                       # batches, runner.launch_parts)
    return self._postprocess(previous step)            # append tokens, finish, report

With overlap (CUDA by default), step N+1 is scheduled, built and queued while the device still runs
step N; step N's sampled ids feed N+1's decode rows on the device, and the host reads them back
after queueing N+1. A request that ends by EOS or a stop token at step N has one more row in
step N+1, whose result is dropped (its epoch changed). Without overlap, every step waits for itself.

`submit` and `cancel` may be called from any thread; `step` from one thread.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from dataclasses import dataclass, field

import torch

from lorafleet.runner.engine.batcher import Batcher
from lorafleet.runner.engine.block_manager import BlockManager
from lorafleet.runner.config import EngineConfig, KernelChoices, ModelConfig
from lorafleet.runner.executor.executor import build_executor
from lorafleet.runner.executor.model_runner import NOT_FINITE
from lorafleet.runner.lora.manager import AdapterManager
from lorafleet.runner.model.decoder import Decoder
from lorafleet.runner.model.fp8 import SM90_MAX_ROWS
from lorafleet.runner.engine.sequence import Sequence
from lorafleet.runner.engine.step_batch import StepBatch, build_step_batch

log = logging.getLogger(__name__)

@dataclass
class StepOutput:
    """What one step did to one request: new token ids, and the end if it ended."""

    seq_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | cancelled | evicted | error
    error: str | None = None
    output_ids: list[int] | None = None  # all generated ids, set when finished
    cached_tokens: int | None = None  # with the request's first token: prompt tokens found in the prefix cache
    # per new token, for a request that asks (SamplingParams.logprobs): [log-probability, [[id, log-probability], ...]]
    logprobs: list | None = None
    # for a request that asks (SamplingParams.prompt_logprobs): the entries of the prompt positions computed in
    # this step, in order (all of them over its prefill: one per prompt token after the first)
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def invariant_kernels(kernels: KernelChoices) -> KernelChoices:
    """The kernel choices of a batch-invariant engine (EngineConfig.batch_invariant): the decode rows' attention on the
    project's kernel (its chunks follow a request's own length; flashinfer's decode splits a request's K/V by a plan
    of the whole batch), or, where decode_kernel names flashinfer's (LORAFLEET_DECODE_KERNEL), flashinfer's
    tensor-core decode with every request's K/V one chunk (decode_no_split)."""
    if kernels.decode_kernel == "flashinfer":
        log.info("batch-invariant decoding on flashinfer's tensor-core decode, every request's K/V unsplit")
        return dataclasses.replace(kernels, decode_tc="1", decode_no_split=True)
    return dataclasses.replace(kernels, decode_kernel="lorafleet")


def invariance_gaps(config: EngineConfig, device: torch.device, model, attention) -> list[str]:
    """What keeps a batch-invariant engine's decode rows from being independent of their step's other rows, as built:
    its products where they are not on the wgmma kernel, its decode attention where it is not on the project's."""
    if device.type != "cuda":
        return ["the CPU's matrix products depend on the number of rows"]
    gaps = []
    if not getattr(model, "bf16_sm90", False):
        gaps.append("the decode products and the lm_head take cuBLAS (FP8 weights, a GPU other than compute "
                    "capability 9.0, a build without CUTLASS's headers, or LORAFLEET_BF16_SM90=0), which does not "
                    "promise rows that do not depend on the row count")
    elif config.max_batch_size > SM90_MAX_ROWS:
        gaps.append(f"decode steps of more than {SM90_MAX_ROWS} rows (max batch size {config.max_batch_size}) take "
                    "cuBLAS's products")
    if getattr(attention, "own", False) is None and not getattr(attention, "decode_no_split", False):
        gaps.append("the decode attention stays on flashinfer's (the project's kernel does not take this model), "
                    "which plans its split of long contexts over the whole batch")
    return gaps


def _check_split(model: str, shard) -> None:
    """A model directory's split over the ranks, checked from its config.json before any rank starts: a model the
    ranks cannot share is refused at once, not after G - 1 processes have started and each failed on it (a GGUF
    file or a source is checked by each rank as it loads)."""
    from pathlib import Path

    from lorafleet.models.registry import family_for
    from lorafleet.runner.model.weights import read_hf_config, typed_config

    path = Path(model)
    if (path / "config.json").is_file():
        hf = read_hf_config(path)
        shard.check(typed_config(family_for(hf), hf, path.name))


class Engine:
    """`model` is a model path (HF directory, .gguf or synthetic directory) or an already built Decoder
    (shared weights, e.g. for benchmarks). `adapter_loader(ref) -> LoadedAdapter` replaces reading
    adapters from disk (the default). Kernel choices (`config.kernels`, else the environment's) are
    resolved, validated and logged here, once."""

    def __init__(self, model: "str | Decoder", config: EngineConfig = EngineConfig(), adapter_loader=None):
        if config.kernels is None:
            config = dataclasses.replace(config, kernels=KernelChoices.from_env())
        if config.batch_invariant:
            config = dataclasses.replace(config, kernels=invariant_kernels(config.kernels))
        log.info("%s", config.kernels.describe())
        self.config = config
        self.tp = None  # TPWorkers of ranks 1..G-1 with tensor parallelism
        self._group = None
        shard = group = None
        device = None
        if config.tp > 1:
            if isinstance(model, Decoder):
                raise ValueError("tensor parallelism needs a model path (every rank loads its own slices)")
            from lorafleet.runner.parallel.group import TPGroup, free_port
            from lorafleet.runner.parallel.shard import Shard
            from lorafleet.runner.engine.tp_workers import TPWorkers, rank_device

            _check_split(str(model), Shard(0, config.tp))
            device = rank_device(config, 0)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            port = free_port()
            self.tp = TPWorkers(config.tp, str(model), config, port)
            shard, group = Shard(0, config.tp), TPGroup(0, config.tp, port, device)
        self._group = group
        try:
            ex = build_executor(model, config, shard, group, device)
            if self.tp is not None:
                self.tp.wait_ready()
        except BaseException:
            self.close()
            raise
        self.executor = ex
        self.model, self.device, self.dtype = ex.model, ex.device, ex.dtype
        if config.batch_invariant:
            for gap in invariance_gaps(config, ex.device, ex.model, ex.attention):
                log.warning("batch-invariant decoding does not hold everywhere here: %s", gap)
        self.model_config: ModelConfig = ex.model.full_cfg
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.lora_pool, self.kv, self.attention, self.sgmv = ex.lora_pool, ex.kv, ex.attention, ex.sgmv
        self.runner = ex.runner
        self.adapters = None
        if self.lora_pool is not None:
            stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            self.adapters = AdapterManager(self.lora_pool, self.model_config.base_shape(), config.host_lora_cache,
                                           adapter_loader, stream, allow_synthetic=config.allow_synthetic,
                                           readers=config.adapter_reader_count(),
                                           pin_reads=config.kernels.pin_host_adapters)
            if self.tp is not None:
                self.adapters.on_slot = lambda ev: self.tp.send(("slot", ev))
        self.blocks = BlockManager(ex.num_pages, config.page_size, caching=config.prefix_cache)
        admit = config.admit_batch
        if admit is None:
            admit = max(1, config.max_batch_size // 8) if self.device.type == "cuda" else 1
        self.max_step_tokens = ex.max_step_tokens
        # CUDA: loads are asynchronous, so start those of the requests after the batch, as many as the
        # slots beyond a full batch hold. CPU: loads are synchronous; only the requests being admitted.
        lookahead = 0
        if self.adapters is not None and self.device.type == "cuda":
            lookahead = max(0, self.lora_pool.num_slots - config.max_batch_size)
        self.batcher = Batcher(self.blocks, self.adapters, config.max_batch_size, config.max_prefill_tokens,
                               self.max_model_len, admit_batch=admit, admit_wait_steps=config.admit_wait_steps,
                               max_step_tokens=self.max_step_tokens, adapter_lookahead=lookahead,
                               decode_prefill_tokens=self.config.decode_prefill_tokens, identity=self._identity,
                               reuse_next_step=config.batch_invariant)
        self.overlap = config.overlap if config.overlap is not None else self.device.type == "cuda"
        log.info("KV cache: %d pages x %d tokens (%d tokens, %s); attention=%s sgmv=%s%s", ex.num_pages, config.page_size,
                 self.blocks.total_tokens, "FP8 e4m3" if config.kv_cache_dtype == "fp8" else "model dtype",
                 self.attention.name, getattr(self.sgmv, "name", "?"),
                 f"; tensor parallel over {config.tp} ranks" if self.tp else "")

        self._eos_ids = tuple(self.model_config.eos_token_ids)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._seqs: dict[str, Sequence] = {}
        self._inflight = None  # the launched step whose results are not read yet (overlap)
        self.last_busy = time.time()
        self.steps = 0
        self.last_step = (0, 0)  # (prefill tokens, decode requests) of the last launched step
        self.requeued = 0  # evicted requests resumed here (requeue_evicted)
        self.last_step_kv = (0, 0)  # (KV tokens attended, distinct adapters) of the last launched step

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and leave the group (nothing to do for one GPU).
        Idempotent. One tensor-parallel engine per process at a time."""
        if getattr(self, "adapters", None) is not None:
            self.adapters.close()
        if self.tp is not None:
            self.tp.close()
        if self._group is not None:
            self._group.close()
            self._group = None

    # -- public API -----------------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        """Queue a request (thread-safe). Its outputs appear in later `step()` results."""
        self._inbox.put(("add", seq))

    def cancel(self, seq_id: str) -> None:
        """Cancel a request at any time (thread-safe); its pages are freed on the next step."""
        self._inbox.put(("cancel", seq_id))

    def has_work(self) -> bool:
        return bool(self._seqs) or not self._inbox.empty() or self._inflight is not None

    def step(self) -> list[StepOutput]:
        """Schedule and queue one step; return what finished steps produced (with overlap, the
        results of the step queued by the previous call)."""
        outputs = self._drain_inbox()
        return outputs + self.run_plan(self.batcher.schedule(), idle_wait=not outputs)

    def run_plan(self, plan, idle_wait: bool = False) -> list[StepOutput]:
        """Queue a scheduled plan's step and read back the previous step's ids (see `step`)."""
        outputs = [self._finish(s) for s in plan.evicted + plan.failed]
        prev, launched = self._inflight, None
        if plan.work:
            parts = [plan.work]
            if self.config.batch_invariant and plan.num_decode and plan.prefill_tokens:  # decode rows on their own
                parts = [[w for w in plan.work if w.decode], [w for w in plan.work if not w.decode]]
            batches = [build_step_batch(work, self.config.page_size, self.config.max_batch_size,
                                        prev.batch if prev is not None else None, pin=self.device.type == "cuda",
                                        eos_ids=self._eos_ids) for work in parts]
            if self.tp is not None:
                self.tp.check()
                self.tp.send(("step", [b.to_wire() for b in batches]))
            launched = self.runner.launch_parts(batches, prev)
            for w in plan.work:
                if w.sample:
                    w.seq.num_pending += 1
            self.last_step = (plan.prefill_tokens, plan.num_decode)
            self.last_step_kv = (sum(sum(b.kv_lens) for b in batches),
                                 len({s for b in batches for s in b.seg_slots if s >= 0}))
            self.last_busy = time.time()
            self.steps += 1
        self._inflight = launched
        if not self.overlap and launched is not None:
            prev, self._inflight = launched, None
        if prev is not None:
            for part in prev.parts:  # (one, or a step run as two passes: InFlightParts)
                tokens = part.tokens(self.tp.check if self.tp is not None else None)
                outputs += self._postprocess(part.batch, tokens, part.logprobs(), part.prompt_logprobs())
        elif idle_wait and not plan.work and self.batcher.waiting and not outputs:
            time.sleep(0.0005)  # only adapter loads are pending: let their worker threads run
        return outputs

    def state(self) -> dict:
        """Numbers the runner service reports (batch, KV, adapters)."""
        running: dict[str, int] = {}
        for s in self.batcher.running:
            if s.adapter_name:
                running[s.adapter_name] = running.get(s.adapter_name, 0) + 1
        waiting: dict[str, int] = {}
        for s in self.batcher.waiting:
            if s.adapter_name:
                waiting[s.adapter_name] = waiting.get(s.adapter_name, 0) + 1
        busy = self.batcher.num_unfinished > 0
        return {
            "batch_size": len(self.batcher.running),
            "max_batch_size": self.config.max_batch_size,
            "waiting": len(self.batcher.waiting),
            "free_kv_tokens": self.blocks.free_tokens,
            "total_kv_tokens": self.blocks.total_tokens,
            "idle_seconds": 0.0 if busy else round(time.time() - self.last_busy, 3),
            "running_adapters": running,
            "waiting_adapters": waiting,
            "resident_adapters": self.adapters.resident() if self.adapters else [],
            "adapter_pool": self.adapters.state() if self.adapters else {},
            "prefix_cache": {"enabled": self.blocks.caching, "cached_pages": self.blocks.cached_pages,
                             **self.blocks.stats},
        }

    # -- internals --------------------------------------------------------------------------------
    def _identity(self, seq: Sequence) -> str:
        """What the prefix cache keys a request's pages by: the base model, or its adapter's weights."""
        return "base" if seq.adapter is None else self.adapters.identity(seq.slot)

    def _drain_inbox(self) -> list[StepOutput]:
        outputs = []
        while True:
            try:
                op, arg = self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            if op == "add":
                error = self._refusal(arg)
                if error is not None:
                    arg.finish_reason, arg.error = "error", error
                    outputs.append(StepOutput(arg.id, [], "error", arg.error, list(arg.output_ids)))
                    continue
                arg.max_len = self.max_model_len
                self._seqs[arg.id] = arg
                self.batcher.add(arg)
            elif op == "cancel":
                seq = self._seqs.get(arg)
                if seq is not None:
                    self.batcher.remove(seq)
                    seq.finish_reason = "cancelled"
                    outputs.append(self._finish(seq))

    def _refusal(self, seq: Sequence) -> str | None:
        """Why a submitted request cannot run here (its id is taken, a token id is outside the vocabulary:
        the embedding lookup would fault), or None."""
        if seq.id in self._seqs:
            return f"request id {seq.id!r} is already running"
        vocab = self.model_config.vocab_size
        bad = next((t for t in seq.prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            return f"token id {bad} is outside the model's vocabulary [0, {vocab})"
        p = seq.params
        bad = next((t for t in (*p.stop_token_ids, *(i for i, _ in p.logit_bias)) if not 0 <= t < vocab), None)
        if bad is not None:
            return f"token id {bad} of stop_token_ids or logit_bias is outside the model's vocabulary [0, {vocab})"
        return None

    def _finish(self, seq: Sequence) -> StepOutput:
        self._seqs.pop(seq.id, None)
        if seq.finish_reason == "evicted" and self.config.requeue_evicted:
            # Offline use: resume here later by prefill on prompt + generated ids.
            seq.finish_reason = None
            self.requeued += 1
            self._seqs[seq.id] = seq
            self.batcher.add(seq)
            return StepOutput(seq.id)
        return StepOutput(seq.id, [], seq.finish_reason, seq.error, list(seq.output_ids))

    def _postprocess(self, batch: StepBatch, tokens: list[int], logprobs: list | None = None,
                     prompt_logprobs: dict[int, list] | None = None) -> list[StepOutput]:
        """Append each sampled id to its request (unless the request left the batch since the step
        was scheduled), and finish requests at EOS, a stop token, max_tokens or the context end. `logprobs`:
        per sampled row, what `InFlight.logprobs` gives (None, or None for a row that asked for none);
        `prompt_logprobs`: what `InFlight.prompt_logprobs` gives, reported before the request's token."""
        eos = set(self.model_config.eos_token_ids)
        outputs = []
        for b, entries in (prompt_logprobs or {}).items():
            seq = batch.seqs[b]
            if seq.epoch == batch.epochs[b]:
                outputs.append(StepOutput(seq.id, prompt_logprobs=entries))
        for j, b in enumerate(batch.sample_idx):
            seq, tok = batch.seqs[b], tokens[j]
            if seq.epoch != batch.epochs[b]:
                continue  # finished, cancelled or evicted after this step was queued: stale
            seq.num_pending -= 1
            if tok == NOT_FINITE:  # its logits held a NaN or an infinity: an error, not a token
                self.batcher.remove(seq)
                self._seqs.pop(seq.id, None)
                via = f"adapter {seq.adapter_name!r}" if seq.adapter_name else "the base model"
                seq.finish_reason, seq.error = "error", (
                    f"the model's output was not finite (NaN or infinity) at output token {len(seq.output_ids) + 1} "
                    f"({via}); the request was stopped")
                outputs.append(StepOutput(seq.id, [], "error", seq.error, list(seq.output_ids)))
                continue
            seq.output_ids.append(tok)
            p = seq.params
            if p.penalized:  # (the counts the penalties read, step_batch._adjust_row)
                seq.out_counts[tok] = seq.out_counts.get(tok, 0) + 1
            reason = None
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in eos):
                reason = "stop"
            elif len(seq.output_ids) >= p.max_tokens or len(seq.prompt_ids) + len(seq.output_ids) >= self.max_model_len:
                reason = "length"
            out = StepOutput(seq.id, [tok], cached_tokens=seq.cached_tokens if len(seq.output_ids) == 1 else None)
            if logprobs is not None and logprobs[j] is not None:
                out.logprobs = [logprobs[j]]
            if reason is not None:
                self.batcher.remove(seq)
                seq.finish_reason = reason
                self._seqs.pop(seq.id, None)
                out.finish_reason, out.output_ids = reason, list(seq.output_ids)
            outputs.append(out)
        return outputs

    def abort_all(self, message: str) -> list[StepOutput]:
        """Fail every admitted request (after an engine error) so no caller waits forever."""
        self._inflight = None
        outs = []
        for seq in list(self.batcher.running) + list(self.batcher.waiting):
            self.batcher.remove(seq)
            self._seqs.pop(seq.id, None)
            seq.finish_reason, seq.error = "error", message
            outs.append(StepOutput(seq.id, [], "error", message, list(seq.output_ids)))
        return outs

    def run_to_completion(self, seqs: list[Sequence], progress=None) -> dict[str, StepOutput]:
        """Offline helper: submit all, step until all finish; final output per id, with all of a request's
        log-probability entries (`logprobs`, `prompt_logprobs`) where it asked for them."""
        for s in seqs:
            self.submit(s)
        done: dict[str, StepOutput] = {}
        lps: dict[str, list] = {}
        plps: dict[str, list] = {}
        need = {s.id: len(s.prompt_ids) - 1 for s in seqs}  # prompt entries (a requeued request reports them again)
        while self.has_work():
            for out in self.step():
                if out.logprobs is not None:
                    lps.setdefault(out.seq_id, []).extend(out.logprobs)
                if out.prompt_logprobs is not None:
                    plps.setdefault(out.seq_id, []).extend(out.prompt_logprobs)
                if out.finished:
                    out.logprobs, out.prompt_logprobs = lps.pop(out.seq_id, None), plps.pop(out.seq_id, None)
                    if out.prompt_logprobs is not None:  # the last full pass over its prompt
                        out.prompt_logprobs = out.prompt_logprobs[-need[out.seq_id]:] if need[out.seq_id] else []
                    done[out.seq_id] = out
                    if progress is not None:
                        progress(out)
        return done


