"""Runs one step batch on the model and samples, without waiting for the device.

    handle = runner.launch(batch, prev)   # the batch's copies to the device, forward, sampling, readback
    ids = handle.tokens()                 # waits for this step only: ids in batch.sample_idx order
    lps = handle.logprobs()               # then, for rows that asked (batch.logprobs), their log-probabilities

Every executor reads the same `StepBatch` (runner/engine/step_batch.py) and its device copy
(`batch.to_device(...)`, a `DeviceStep`):
decode-only steps replay a CUDA graph per batch bucket (cuda_graph.py), steps with prefill replay
piecewise graphs around eager attention (piecewise.py), steps of long prompt chunks of few adapters run
eagerly with their LoRA written before the base GEMMs (runner/lora/step.py, dense_lora_bounds), and
anything else runs the forward pass eagerly (the CPU path, and the fallback). None of them rebuilds or reorders the batch.

Overlap: `launch` returns as soon as the work is queued on the device. The sampled ids stay on the
device (`InFlight.tokens_dev`), where the next step's input rows read them, and are copied to
pinned host memory behind the step; only `tokens()` waits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from lorafleet.runner.lora.step import LoraStepImpl, dense_lora_bounds
from lorafleet.runner.config import KernelChoices
from lorafleet.runner.model.decoder import Decoder, StepIO, plain_projection_elems
from lorafleet.runner.executor.sampler import adjust_logits, sample_tokens, token_logprobs


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of device tensor `t`, queued behind the work before it (no wait)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


NOT_FINITE = -1  # the id read back for a row whose logits hold a NaN or an infinity (never a vocabulary id)


def reported_tokens(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The ids the host reads back: `tokens`, with NOT_FINITE where the row's logits hold a NaN or +inf (an adapter
    whose weights overflow in the product, say; found by the row maximum, which propagates NaN: one [S] reduction on
    the decode step, no [S, V] mask). The device keeps `tokens` themselves for the next step's input, whose embedding
    lookup must never see an id outside the vocabulary. No host synchronisation."""
    return torch.where(torch.isfinite(logits.amax(-1)), tokens, NOT_FINITE)


class InFlight:
    """A launched step: its batch, sampled ids on the device, and (with `readback`) the pinned host copy of the ids to
    report (`report`, default the sampled ids); with `lp` (sampler.token_logprobs' tensors) their host copies too."""

    def __init__(self, batch: "StepBatch", tokens_dev: torch.Tensor, kind: str, readback: bool = True,
                 lp: tuple[torch.Tensor, ...] | None = None, prompt_lp: tuple[torch.Tensor, ...] | None = None,
                 report: torch.Tensor | None = None):
        self.batch, self.tokens_dev, self.kind = batch, tokens_dev, kind
        self.event = None
        report = tokens_dev if report is None else report
        self.host, self.lp_host, self.prompt_lp_host = report, lp, prompt_lp
        if tokens_dev.is_cuda:
            if readback:
                self.host = _to_host(report)
                if lp is not None:
                    self.lp_host = tuple(_to_host(t) for t in lp)
                if prompt_lp is not None:
                    self.prompt_lp_host = tuple(_to_host(t) for t in prompt_lp)
            self.event = torch.cuda.Event()
            self.event.record()

    @property
    def parts(self) -> list["InFlight"]:
        """The step's parts, read back one by one: itself (InFlightParts: a step run as several passes)."""
        return [self]

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self, poll=None) -> None:
        """Until this step's device work is done. `poll()` (tensor parallelism: are the other ranks
        alive?) runs while waiting and may raise, so a lost rank never leaves this waiting forever."""
        if self.event is None:
            return
        if poll is None:
            self.event.synchronize()
            return
        while not self.event.query():
            poll()
            time.sleep(20e-6)

    def tokens(self, poll=None) -> list[int]:
        """The sampled ids, in `batch.sample_idx` order (waits for this step's device work)."""
        self.wait(poll)
        return self.host.tolist()

    def logprobs(self) -> list[list | None] | None:
        """After `tokens()`: per sampled row, None or [its token's log-probability, [[id, log-probability], ...]
        with as many alternatives as the row asked for (`batch.logprobs`)]; None when no row asked."""
        if self.lp_host is None:
            return None
        return _entries(self.lp_host, self.batch.logprobs)

    def prompt_logprobs(self) -> dict[int, list] | None:
        """After `tokens()`: per request index of the batch, the entries (as `logprobs` gives them) of its prompt
        positions computed in this step, in order; None when no request asked."""
        rows = self.batch.prompt_rows
        if self.prompt_lp_host is None or rows is None:
            return None
        out: dict[int, list] = {}
        for b, e in zip(rows.owner, _entries(self.prompt_lp_host, rows.k)):
            out.setdefault(b, []).append(e)
        return out


class PartsBatch:
    """What the next step reads of a step run in parts (build_step_batch's `prev`): where each request's sampled
    id is in the parts' ids laid end to end."""

    def __init__(self, parts: list[InFlight]):
        self.sample_pos: dict[int, int] = {}
        base = 0
        for p in parts:
            self.sample_pos.update({k: base + j for k, j in p.batch.sample_pos.items()})
            base += len(p.batch.sample_idx)


class InFlightParts:
    """A step launched as separate forward passes (EngineConfig.batch_invariant: its decode rows, then its prompt
    rows), each an InFlight of its own part (`parts`, read back one by one). To the step after it, it is one step:
    `tokens_dev` the parts' sampled ids end to end, `batch.sample_pos` indexing them."""

    def __init__(self, parts: list[InFlight]):
        self.parts = parts
        self.batch = PartsBatch(parts)
        self.tokens_dev = torch.cat([p.tokens_dev for p in parts])

    def wait(self, poll=None) -> None:
        for p in self.parts:
            p.wait(poll)


def _entries(lp: tuple[torch.Tensor, ...], ks: list[int]) -> list[list | None]:
    """token_logprobs' tensors on the host -> per row None (k < 0) or [log-probability, [[id, lp], ...k]]."""
    chosen, ids, vals = (t.tolist() for t in lp)
    return [None if k < 0 else [chosen[j], [[i, v] for i, v in zip(ids[j][:k], vals[j][:k])]]
            for j, k in enumerate(ks)]


class ModelRunner:
    def __init__(self, model: Decoder, attention, lora_pool, sgmv, page_size: int, graphs=None, mixed=None,
                 kernels: KernelChoices = KernelChoices()):
        self.model, self.attention, self.kernels = model, attention, kernels
        self.lora_pool, self.sgmv = lora_pool, sgmv
        self.page_size = page_size
        self.graphs = graphs  # GraphRunner for decode-only steps on CUDA, or None
        self.mixed = mixed  # PiecewiseGraphs for steps with prefill, or None
        self._workspace: torch.Tensor | None = None
        self._layer_elems: int | None = None  # for LoRA's dense path (_dense_lora)
        # Optional wall-clock split of launches for profiling: {kind: [copy_s, launch_s, sample_s, n]}.
        self.phases: dict[str, list[float]] | None = None

    @torch.inference_mode()
    def launch(self, batch: "StepBatch", prev: InFlight | None = None, readback: bool = True) -> InFlight:
        """Queue one step on the device; `prev` is the step launched before it (for pending ids).
        `readback=False`: no host copy of the sampled ids (tensor-parallel ranks other than 0)."""
        t0 = time.perf_counter() if self.phases is not None else 0.0
        d = batch.to_device(self.model.device, prev.tokens_dev if prev is not None else None)
        t1 = time.perf_counter() if self.phases is not None else 0.0
        logits = None
        kind = "eager"
        dense = self._dense_lora(batch, d)
        prompt_logits = None
        if dense is not None or d.prompt_rows is not None:
            # long prompt chunks: eagerly, their LoRA written before the base GEMMs; prompt rows whose
            # log-probabilities are asked for: eagerly too, their logits apart (StepIO.extra_rows)
            io = self._forward_io(batch, d, dense)
            kind, logits, prompt_logits = "dense" if dense is not None else "eager", io.logits, io.extra_logits
        elif batch.decode_only and self.graphs is not None and self.graphs.bucket(batch.batch_size) is not None:
            kind, logits = "graph", self.graphs.run(batch, d)
        elif self.mixed is not None:
            logits = self.mixed.run(batch, d)
            kind = "piecewise"
        if logits is None:
            kind, logits = "eager", self.forward(batch, d)
        t2 = time.perf_counter() if self.phases is not None else 0.0
        if len(batch.sample_idx) < batch.batch_size:
            logits = logits.index_select(0, d.sample_idx)
        tokens = sample_tokens(adjust_logits(logits, d.adjust, d.input_ids) if d.adjust is not None else logits,
                               d.sampling)
        k = batch.max_logprobs
        lp = token_logprobs(logits, tokens, k) if readback and k >= 0 else None
        plp = None
        if readback and prompt_logits is not None:
            plp = token_logprobs(prompt_logits, d.prompt_rows[1], max(batch.prompt_rows.k))
        out = InFlight(batch, tokens, kind, readback, lp, plp, reported_tokens(logits, tokens) if readback else None)
        if self.phases is not None:
            acc = self.phases.setdefault(kind, [0.0, 0.0, 0.0, 0])
            t3 = time.perf_counter()
            acc[0] += t1 - t0  # host: the batch's copy to the device
            acc[1] += t2 - t1  # host: attention plans and kernel launches (or graph replay)
            acc[2] += t3 - t2  # host: sampling launches and the readback request
            acc[3] += 1
        return out

    def launch_parts(self, batches: list["StepBatch"], prev=None, readback: bool = True) -> "InFlight | InFlightParts":
        """`launch` for a step of one batch, or of several parts run one after another (EngineConfig.batch_invariant),
        each reading its pending ids from `prev`: only the first part may have any (the decode rows)."""
        if len(batches) == 1:
            return self.launch(batches[0], prev, readback)
        if any(b.num_pending for b in batches[1:]):
            raise ValueError("launch_parts: only the first part of a step may read ids still pending on the device")
        return InFlightParts([self.launch(b, prev, readback) for b in batches])

    def _dense_lora(self, batch: "StepBatch", d: "DeviceStep") -> list[tuple[int, int, int]] | None:
        """The adapted segments of a step that takes LoRA's dense path (runner/lora/step.py), else None."""
        if self.lora_pool is None or batch.decode_only or not d.seg.any_adapter:
            return None
        if self._layer_elems is None:  # one layer's projection weights on this rank; 0 with FP8 weights (never)
            self._layer_elems = plain_projection_elems(self.model.layers[0])
        if not self._layer_elems:
            return None
        return dense_lora_bounds(d.seg, batch.num_tokens, self.kernels, self._layer_elems)

    def forward(self, batch: "StepBatch", d: "DeviceStep", dense: list[tuple[int, int, int]] | None = None
                ) -> torch.Tensor:
        """The whole step eagerly: logits fp32 [B, V] (one row per request, its last row). `dense`: the
        step's adapted segments on LoRA's dense path."""
        return self._forward_io(batch, d, dense).logits

    def _forward_io(self, batch: "StepBatch", d: "DeviceStep", dense: list[tuple[int, int, int]] | None = None
                    ) -> StepIO:
        """`forward`, returning the step's StepIO: its logits and, for the prompt rows the step carries
        (d.prompt_rows), their logits in `extra_logits`."""
        attn_step = self.attention.begin(d.attn_meta(batch))
        lora = None
        if self.lora_pool is not None and d.seg.any_adapter:
            lora = LoraStepImpl(self.lora_pool, self.sgmv, d.seg, self._workspace, kernels=self.kernels, dense=dense)
            self._workspace = lora.ws
        io = StepIO(d.input_ids, d.positions, d.slot_mapping, d.logit_rows,
                    extra_rows=d.prompt_rows[0] if d.prompt_rows is not None else None)
        self.model.forward(io, attn_step, lora)
        return io
