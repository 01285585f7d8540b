"""The step batch: everything one engine step computes, as plain host data, built in one place.

    plan  = batcher.schedule()                   # which rows of which requests (RowWork)
    batch = build_step_batch(plan.work, ...)     # this module: the only producer
    runner.launch(batch, prev)                   # eager, decode graph or piecewise graph: all read it
    runner.launch_parts([decode, prompt], prev)  # EngineConfig.batch_invariant: a step as two batches

Row layout (Punica §5): one flat token batch; prefill (and prefill-chunk) rows first, then decode
rows, each part grouped by adapter slot so every adapter is one contiguous segment; a slot shared
by both parts sits at the seam (one segment across it). The segment table is built here once and
reused by every layer.

Everything an executor needs is in the batch as numbers: no executor reads a `Sequence`, so a
tensor-parallel rank can replay the same batch from its serialised form (`to_wire` / `from_wire`).
Decode rows whose input token was sampled by the previous step and is still on the device
(overlapped scheduling) name it in `pending_rows` / `pending_src`: the runner copies
`prev_tokens[pending_src]` into those rows on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from lorafleet.runner.engine.sequence import Sequence
from lorafleet.runner.executor.attention.meta import AttnMeta
from lorafleet.runner.executor.sampler import DeviceAdjust, LogitAdjust, PromptRows, pack_sampling, uniform_for
from lorafleet.runner.lora.segments import SegmentTable, merge_runs


@dataclass(frozen=True)
class RowWork:
    """Rows of one request in one step: the K/V of positions `start:end` are computed; with
    `sample` the step also samples the token at position `end` (the request's next token)."""

    seq: Sequence
    start: int
    end: int
    sample: bool

    @property
    def num_rows(self) -> int:
        return self.end - self.start

    @property
    def decode(self) -> bool:
        return self.end - self.start == 1 and self.sample and self.start > 0


@dataclass
class StepBatch:
    """One step in batch order. B requests (`num_prefill` prefill-like first), T token rows,
    S sampled requests. Host data only; `packed64` / `packed32` are what crosses to the device."""

    seqs: list[Sequence]  # [B] (host bookkeeping only; executors never read them)
    epochs: list[int]  # [B] each request's epoch when scheduled
    num_prefill: int
    num_tokens: int  # T
    qo_indptr: list[int]  # [B + 1]
    kv_lens: list[int]  # [B] KV length after this step
    page_tables: list[list[int]]  # [B]
    page_size: int
    seg_indptr: tuple[int, ...]  # [n + 1] real segments
    seg_slots: tuple[int, ...]  # [n]
    seg_capacity: int  # padded capacity of the device table
    sample_idx: list[int]  # [S] request indices (into seqs) whose next token is sampled
    temperature: list[float]  # [S]
    top_p: list[float]  # [S]
    top_k: list[int]  # [S]
    uniform: list[float]  # [S] the sampling draw of each (seed, position)
    # int64 [3T + B + 2P + S]: input_ids | positions | slot_mapping | logit_rows | pending_rows | pending_src
    # | sample_idx
    packed64: torch.Tensor
    packed32: torch.Tensor  # int32 [2 * capacity + 1]: seg indptr (padded) | seg slots (padded with -1)
    num_pending: int  # P
    # float32 [5, S]: temperature | top_p | top_k | uniform | min_p (sampler.pack_sampling); None if all greedy
    packedf: torch.Tensor | None = None
    sample_pos: dict[int, int] = field(default_factory=dict)  # id(seq) -> index of its sampled token
    # [S] alternatives each sampled row asks for with its token's log-probability (-1: none asked); empty when no
    # row asks (host bookkeeping: the rank that reads the samples back computes them, sampler.token_logprobs)
    logprobs: list[int] = field(default_factory=list)
    min_p: list[float] = field(default_factory=list)  # [S]
    adjust: LogitAdjust | None = None  # the logit changes before sampling, when a row asks (sampler.adjust_logits)
    prompt_rows: PromptRows | None = None  # prompt positions whose log-probabilities a request asks for

    @property
    def batch_size(self) -> int:
        return len(self.kv_lens)

    @property
    def num_decode(self) -> int:
        return self.batch_size - self.num_prefill

    @property
    def num_prefill_tokens(self) -> int:
        return self.qo_indptr[self.num_prefill]

    @property
    def decode_only(self) -> bool:
        return self.num_prefill == 0

    @property
    def max_logprobs(self) -> int:
        """The most alternatives any sampled row asks for; -1 when no row asks for log-probabilities."""
        return max(self.logprobs, default=-1)

    # -- serialised form for tensor-parallel ranks ----------------------------------------------
    def to_device(self, device, prev_tokens=None) -> "DeviceStep":
        """The batch's numbers on `device` (see `to_device`)."""
        return to_device(self, device, prev_tokens)

    def to_wire(self) -> dict:
        """Plain data (lists and bytes) that `from_wire` turns back into an equivalent batch."""
        return {
            "num_prefill": self.num_prefill, "num_tokens": self.num_tokens, "qo_indptr": self.qo_indptr,
            "kv_lens": self.kv_lens, "page_tables": self.page_tables, "page_size": self.page_size,
            "seg_indptr": list(self.seg_indptr), "seg_slots": list(self.seg_slots), "seg_capacity": self.seg_capacity,
            "sample_idx": self.sample_idx, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "uniform": self.uniform, "min_p": self.min_p, "num_pending": self.num_pending,
            "adjust": self.adjust.to_wire() if self.adjust is not None else None,
            "prompt_rows": self.prompt_rows.to_wire() if self.prompt_rows is not None else None,
            "packed64": self.packed64.numpy().tobytes(), "packed32": self.packed32.numpy().tobytes(),
        }

    @classmethod
    def from_wire(cls, w: dict, pin: bool = False) -> "StepBatch":
        p64 = torch.from_numpy(np.frombuffer(w["packed64"], dtype=np.int64).copy())
        p32 = torch.from_numpy(np.frombuffer(w["packed32"], dtype=np.int32).copy())
        pf = pack_sampling(w["temperature"], w["top_p"], w["top_k"], w["uniform"], w["min_p"])
        if pin:
            p64, p32 = p64.pin_memory(), p32.pin_memory()
            pf = pf.pin_memory() if pf is not None else None
        return cls(seqs=[], epochs=[], num_prefill=w["num_prefill"], num_tokens=w["num_tokens"],
                   qo_indptr=list(w["qo_indptr"]), kv_lens=list(w["kv_lens"]),
                   page_tables=[list(p) for p in w["page_tables"]], page_size=w["page_size"],
                   seg_indptr=tuple(w["seg_indptr"]), seg_slots=tuple(w["seg_slots"]), seg_capacity=w["seg_capacity"],
                   sample_idx=list(w["sample_idx"]), temperature=list(w["temperature"]), top_p=list(w["top_p"]),
                   top_k=list(w["top_k"]), uniform=list(w["uniform"]), packed64=p64, packed32=p32,
                   num_pending=w["num_pending"], packedf=pf, min_p=list(w["min_p"]),
                   adjust=LogitAdjust.from_wire(w["adjust"]) if w["adjust"] is not None else None,
                   prompt_rows=PromptRows.from_wire(w["prompt_rows"]) if w["prompt_rows"] is not None else None)


def split64(p: torch.Tensor, T: int, B: int, P: int, S: int) -> dict[str, torch.Tensor]:
    o = 0
    out = {}
    for name, n in (("input_ids", T), ("positions", T), ("slot_mapping", T), ("logit_rows", B),
                    ("pending_rows", P), ("pending_src", P), ("sample_idx", S)):
        out[name] = p[o: o + n]
        o += n
    return out


def order_for_segments(prefill: list[RowWork], decode: list[RowWork]) -> tuple[list[RowWork], list[RowWork]]:
    """Group each part by adapter slot; put a slot shared by both parts at the seam."""
    shared = sorted({w.seq.slot for w in prefill} & {w.seq.slot for w in decode})
    seam = shared[0] if shared else None
    pre = sorted(prefill, key=lambda w: (w.seq.slot == seam, w.seq.slot, w.seq.age_key))
    dec = sorted(decode, key=lambda w: (w.seq.slot != seam, w.seq.slot, w.seq.age_key))
    return pre, dec


def build_step_batch(work: list[RowWork], page_size: int, seg_capacity: int, prev: StepBatch | None = None,
                     pin: bool = False, eos_ids: tuple[int, ...] = ()) -> StepBatch:
    """The step batch of the scheduled `work`. `prev` is the step launched before this one: a
    request whose last token is still pending on the device reads it from that step's samples. `eos_ids`: what
    `min_tokens` keeps from being sampled besides a request's stop_token_ids (unless it ignores EOS)."""
    prefill, decode = order_for_segments([w for w in work if not w.decode], [w for w in work if w.decode])
    order = prefill + decode
    ids: list[int] = []
    pos: list[int] = []
    slot_map: list[int] = []
    row_slots: list[int] = []
    qo_indptr = [0]
    kv_lens: list[int] = []
    logit_rows: list[int] = []
    pending_rows: list[int] = []
    pending_src: list[int] = []
    sample_idx: list[int] = []
    temperature, top_p, top_k, uniform = [], [], [], []
    logprobs: list[int] | None = None  # [S] once a row asks
    min_p: list[float] = []
    adjust: LogitAdjust | None = None  # once a row asks
    prompt_rows: PromptRows | None = None  # once a request asks for its prompt's log-probabilities
    sample_pos: dict[int, int] = {}
    for b, w in enumerate(order):
        s = w.seq
        known = s.all_ids
        row0 = qo_indptr[-1]
        n = w.end - w.start
        pending = False
        if n == 1:
            p = w.start
            if p < len(known):
                ids.append(known[p])
            else:  # the token sampled by the previous step, still on the device
                pending = True
                if prev is None or id(s) not in prev.sample_pos:
                    raise RuntimeError(f"request {s.id}: token {p} is pending but no step in flight sampled it")
                ids.append(0)
                pending_rows.append(row0)
                pending_src.append(prev.sample_pos[id(s)])
            pos.append(p)
            slot_map.append(s.pages[p // page_size] * page_size + p % page_size)
        else:  # a prefill chunk: every token is known (a pending token always starts a decode row)
            if w.end > len(known):
                raise RuntimeError(f"request {s.id}: a prefill chunk reaches a pending token")
            ids.extend(known[w.start: w.end])
            pos.extend(range(w.start, w.end))
            first, last = w.start // page_size, (w.end - 1) // page_size
            pages = np.asarray(s.pages[first: last + 1], dtype=np.int64)
            flat = (pages[:, None] * page_size + np.arange(page_size)).ravel()
            off = w.start - first * page_size
            slot_map.extend(flat[off: off + n].tolist())
        if s.params.prompt_logprobs is not None:  # its positions p < end are followed by prompt tokens known[p + 1]
            end = min(w.end, len(s.prompt_ids) - 1)
            if end > w.start:
                prompt_rows = prompt_rows or PromptRows()
                prompt_rows.rows.extend(range(row0, row0 + end - w.start))
                prompt_rows.targets.extend(known[w.start + 1: end + 1])
                prompt_rows.k.extend([s.params.prompt_logprobs] * (end - w.start))
                prompt_rows.owner.extend([b] * (end - w.start))
        row_slots.extend([s.slot] * n)
        qo_indptr.append(row0 + n)
        kv_lens.append(w.end)
        logit_rows.append(row0 + n - 1)
        if w.sample:
            sample_pos[id(s)] = len(sample_idx)
            sample_idx.append(b)
            sp = s.params
            temperature.append(float(sp.temperature))
            top_p.append(float(sp.top_p))
            top_k.append(int(sp.top_k))
            uniform.append(0.0 if sp.greedy else uniform_for(s.sample_seed, w.end))
            if sp.logprobs is not None and logprobs is None:
                logprobs = [-1] * (len(sample_idx) - 1)
            if logprobs is not None:
                logprobs.append(-1 if sp.logprobs is None else sp.logprobs)
            min_p.append(sp.min_p)
            if sp.adjusts_always or (sp.min_tokens and sp.prior_output_tokens + s.num_generated < sp.min_tokens):
                if adjust is None:
                    k = len(sample_idx) - 1
                    adjust = LogitAdjust([0.0] * k, [0.0] * k, [1.0] * k)
                _adjust_row(adjust, len(sample_idx) - 1, s, row0 if pending else -1, eos_ids)
            elif adjust is not None:  # no change for this row
                adjust.presence.append(0.0)
                adjust.frequency.append(0.0)
                adjust.repetition.append(1.0)
    indptr, slots = merge_runs(row_slots)
    cap = max(seg_capacity, len(slots), 1)
    T, B = len(ids), len(order)
    packed64 = torch.tensor(ids + pos + slot_map + logit_rows + pending_rows + pending_src + sample_idx,
                            dtype=torch.int64)
    packed32 = torch.tensor(indptr + [indptr[-1]] * (cap - len(slots)) + slots + [-1] * (cap - len(slots)),
                            dtype=torch.int32)
    packedf = pack_sampling(temperature, top_p, top_k, uniform, min_p)
    if pin:
        packed64, packed32 = packed64.pin_memory(), packed32.pin_memory()
        packedf = packedf.pin_memory() if packedf is not None else None
    return StepBatch(
        seqs=[w.seq for w in order], epochs=[w.seq.epoch for w in order], num_prefill=len(prefill), num_tokens=T,
        qo_indptr=qo_indptr, kv_lens=kv_lens, page_size=page_size,
        page_tables=[w.seq.pages[: -(-w.end // page_size)] for w in order],
        seg_indptr=tuple(indptr), seg_slots=tuple(slots), seg_capacity=cap, sample_idx=sample_idx,
        temperature=temperature, top_p=top_p, top_k=top_k, uniform=uniform, packed64=packed64, packed32=packed32,
        num_pending=len(pending_rows), sample_pos=sample_pos, packedf=packedf, logprobs=logprobs or [], min_p=min_p,
        adjust=adjust, prompt_rows=prompt_rows)


def _adjust_row(adj: LogitAdjust, j: int, seq: Sequence, pending_row: int, eos_ids: tuple[int, ...]) -> None:
    """Sampled row j's part of the step's logit changes (SamplingParams.adjusts_logits): its penalties over the
    output so far (the read-back counts; `pending_row` >= 0: the input row holding its newest, still pending,
    output token), its prompt's distinct ids for the repetition penalty, its logit_bias, and while it has fewer
    than min_tokens outputs, EOS and its stop ids banned."""
    p = seq.params
    adj.presence.append(float(p.presence_penalty))
    adj.frequency.append(float(p.frequency_penalty))
    adj.repetition.append(float(p.repetition_penalty))
    if p.penalized:
        adj.counts.extend((j, t, float(c)) for t, c in seq.out_counts.items())
        if pending_row >= 0:
            adj.pending.append((j, pending_row))
        if p.repetition_penalty != 1.0:
            adj.seen.append((j, seq.prompt_distinct()))
    adj.bias.extend((j, t, b) for t, b in p.logit_bias)
    if p.prior_output_tokens + seq.num_generated < p.min_tokens:
        adj.ban.extend((j, t) for t in dict.fromkeys((*p.stop_token_ids, *(() if p.ignore_eos else eos_ids))))


@dataclass
class DeviceStep:
    """The device copy of a step batch's numbers (T rows, B requests)."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    logit_rows: torch.Tensor  # int64 [B]
    inputs3: torch.Tensor  # int64 [3, T]: input_ids, positions, slot_mapping as one view
    seg: SegmentTable  # device indptr / slots at the batch's capacity, host tuples of the real segments
    sample_idx: torch.Tensor  # int64 [S]: the requests whose next token is sampled
    sampling: torch.Tensor | None  # float32 [5, S] (sampler.pack_sampling), None if every row is greedy
    adjust: DeviceAdjust | None = None  # the logit changes before sampling, None when no row asks
    prompt_rows: torch.Tensor | None = None  # int64 [2, R]: input rows | the prompt tokens that follow them

    def attn_meta(self, batch: StepBatch) -> AttnMeta:
        return AttnMeta(num_prefill=batch.num_prefill, qo_indptr=batch.qo_indptr, kv_lens=batch.kv_lens,
                        page_tables=batch.page_tables, page_size=batch.page_size, slot_mapping=self.slot_mapping)


def to_device(batch: "StepBatch", device: torch.device, prev_tokens: torch.Tensor | None) -> DeviceStep:
    """Two host->device copies (int64 and int32 packs; a third with sampling parameters); pending
    input rows take the previous step's sampled ids on the device. Nothing here waits for the device."""
    T, B, P, S = batch.num_tokens, batch.batch_size, batch.num_pending, len(batch.sample_idx)
    d64 = batch.packed64.to(device, non_blocking=True)
    d32 = batch.packed32.to(device, non_blocking=True)
    df = batch.packedf.to(device, non_blocking=True) if batch.packedf is not None else None
    v = split64(d64, T, B, P, S)
    if P:
        if prev_tokens is None:
            raise RuntimeError("the step batch reads pending tokens but no step is in flight")
        v["input_ids"].index_copy_(0, v["pending_rows"], prev_tokens.index_select(0, v["pending_src"]))
    cap = batch.seg_capacity
    seg = SegmentTable(d32[: cap + 1], d32[cap + 1:], batch.seg_indptr, batch.seg_slots, T)
    return DeviceStep(v["input_ids"], v["positions"], v["slot_mapping"], v["logit_rows"], d64[: 3 * T].view(3, T), seg,
                      v["sample_idx"], df, batch.adjust.to_device(device) if batch.adjust is not None else None,
                      _pinned(torch.tensor([batch.prompt_rows.rows, batch.prompt_rows.targets], dtype=torch.int64),
                              device).to(device, non_blocking=True) if batch.prompt_rows is not None else None)


def _pinned(t: torch.Tensor, device) -> torch.Tensor:
    """`t` in pinned host memory when it goes to a GPU (its copy then queues behind the step, no wait)."""
    return t.pin_memory() if torch.device(device).type == "cuda" else t
