"""Continuous batching: which requests compute which tokens this step, pages and eviction.

Every step, in this order:
1. Decode: every running request whose tokens all have their K/V feeds its last token (one row);
   it needs room for one more KV entry, and when pages run out the *newest* running request is
   evicted (Punica §5.3). A request whose final token is already sampled (max_tokens or the
   context reached, the token still on its way back from the device) is not scheduled.
2. Prefill chunks of running requests part-way through their prompt, oldest first; while a waiting request
   that this step can admit waits (a batch place, its adapter resident, its prompt in the free pages), these
   chunks take at most half of the step's prompt budget, the rest kept for admissions (up to the waiting prompts'
   length), so a short request behind a long prompt starts a step later, not after the whole prompt.
3. Admission: waiting requests oldest first while the batch has room, their adapter is resident
   and their whole prompt fits in free pages (the pages are taken at admission).
Admission is FCFS: a request that does not fit blocks later ones, except requests merely waiting
for an adapter load.

Chunked prefill (`max_step_tokens` set): one step computes at most that many token rows, decode
rows included, so a long prompt is split over several steps and rides along with the decodes
instead of stalling them; with `decode_prefill_tokens`, a step that carries decodes takes at most
that many prompt rows. Without it (None), a step admits prompts up to `max_prefill_tokens`
(one longer prompt still runs alone), as before.

Admission batching (`admit_batch` > 1): while requests run, new ones are admitted only once
`min(admit_batch, waiting)` batch places are free, or after `admit_wait_steps` held steps, so
prompts share prefill steps (which cost more than decode steps) instead of each taking its own.
Adapter loads of the requests next in line start while admission is held, and, up to
`adapter_lookahead` requests, while the batch is full (CUDA engines, where loads are asynchronous:
the slots beyond the batch fill with the adapters of the requests that come next).

Prefix cache (`BlockManager.caching`): an admitted request takes the cached pages of its longest cached
run of full pages (keyed by its adapter's identity and its cache salt, block_manager.py) and computes
only the rest, at least its last token; every full page whose tokens are known is registered as its K/V
is computed, so later requests (and this one, if it is evicted and comes back) find it.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from lorafleet.common.peft_config import AdapterError
from lorafleet.runner.engine.block_manager import BlockManager, chain_keys, key_root
from lorafleet.runner.lora.manager import READY, AdapterManager
from lorafleet.runner.engine.sequence import Sequence, Status
from lorafleet.runner.engine.step_batch import RowWork


@dataclass
class StepPlan:
    work: list[RowWork] = field(default_factory=list)  # in scheduling order
    evicted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # ended here: finish_reason "error" (error set) or "length"

    @property
    def prefill_tokens(self) -> int:
        return sum(w.num_rows for w in self.work if not w.decode)

    @property
    def num_decode(self) -> int:
        return sum(1 for w in self.work if w.decode)


class Batcher:
    def __init__(
        self,
        blocks: BlockManager,
        adapters: AdapterManager | None,
        max_batch_size: int,
        max_prefill_tokens: int,
        max_model_len: int,
        admit_batch: int = 1,
        admit_wait_steps: int = 8,
        max_step_tokens: int | None = None,
        adapter_lookahead: int = 0,
        decode_prefill_tokens: int | None = None,
        identity=None,
        reuse_next_step: bool = False,
    ):
        if admit_batch < 1 or admit_wait_steps < 0:
            raise ValueError("admit_batch must be >= 1 and admit_wait_steps >= 0")
        if max_step_tokens is not None and max_step_tokens < max_batch_size + 1:
            raise ValueError(f"max_step_tokens ({max_step_tokens}) must exceed the max batch size ({max_batch_size}): "
                             "every decode row and at least one prefill row must fit a step")
        if decode_prefill_tokens is not None and decode_prefill_tokens < 1:
            raise ValueError(f"decode_prefill_tokens must be >= 1, got {decode_prefill_tokens}")
        self.max_step_tokens = max_step_tokens
        self.decode_prefill_tokens = decode_prefill_tokens
        self.adapter_lookahead = adapter_lookahead
        self.blocks, self.adapters = blocks, adapters
        self.admit_batch, self.admit_wait_steps = admit_batch, admit_wait_steps
        self._held = 0  # consecutive steps admission was held
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # identity(seq) -> the content identity of the weights the request runs on ("" for the base model)
        self.identity = identity or (lambda seq: "")
        # Steps that may run in several passes (EngineConfig.batch_invariant): the full pages a step computes are
        # cached for the requests of the next step on, not for those admitted in the same step (whose rows may run
        # in a pass before the one that writes them)
        self.reuse_next_step = reuse_next_step
        self._unregistered: list[Sequence] = []

    # -- membership -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a request in arrival order (a resumed request keeps its old place)."""
        seq.status = Status.WAITING
        if not self.waiting or self.waiting[-1].age_key <= seq.age_key:
            self.waiting.append(seq)
            return
        items = sorted([*self.waiting, seq], key=lambda s: s.age_key)
        self.waiting = deque(items)

    def remove(self, seq: Sequence) -> None:
        """Take a request out (finish, cancel, evict, error): its pages are freed at once."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.pages)
        seq.num_registered = 0
        seq.num_cached = 0
        seq.num_pending = 0  # a token still in flight for it is dropped (the epoch below tells)
        seq.epoch += 1
        if seq.slot >= 0 and self.adapters is not None:
            self.adapters.release(seq.slot)
        elif seq.adapter is not None and self.adapters is not None and seq.status == Status.WAITING:
            self.adapters.abandon(seq.adapter)  # it may have been waiting for this adapter's load
        seq.slot = -1
        seq.status = Status.FINISHED

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        for seq in self._unregistered:  # the pages the step before computed (reuse_next_step)
            if seq.status == Status.RUNNING:
                self._register(seq)
        self._unregistered = []
        chunked = self.max_step_tokens is not None
        budget = self.max_step_tokens if chunked else self.max_prefill_tokens
        running = sorted(self.running, key=lambda s: s.age_key)
        # 1. Decode: each request with all K/V computed feeds its last token; it needs room for it.
        for seq in running:
            if seq.status != Status.RUNNING or seq.prefilling or seq.done_generating:
                continue  # evicted below, mid-prompt (2.), or its last token is still in flight
            while not self.blocks.grow(seq.pages, seq.num_tokens):
                victim = max((s for s in self.running), key=lambda s: s.age_key)
                self._evict(victim, plan)
                if victim is seq:
                    break
            if seq.status == Status.RUNNING:
                plan.work.append(RowWork(seq, seq.num_tokens - 1, seq.num_tokens, True))
                if chunked:
                    budget -= 1
        if chunked and plan.work and self.decode_prefill_tokens is not None:
            budget = min(budget, self.decode_prefill_tokens)  # prompt rows that ride along with decodes
        want = min(self.admit_batch, len(self.waiting))
        free = self.max_batch_size - len(self.running)
        hold = (self.admit_batch > 1 and bool(self.running) and free < want
                and (free == 0 or self._held < self.admit_wait_steps))
        if not hold:
            self._held = 0
        elif free > 0:
            self._held += 1  # a full batch admits nobody anyway: only count steps with free places
        # 2. Prefill chunks of requests part-way through their prompt (their pages are taken). While requests that
        # this step can admit wait, those chunks take at most half of the prompt budget: the rest is kept for the
        # waiting prompts (up to their length), so a short request that arrives behind a long prompt starts in the
        # next step rather than after that whole prompt.
        reserve = self._reserve(budget, free) if chunked and not hold else 0
        budget -= reserve
        for seq in running:
            if seq.status != Status.RUNNING or not seq.prefilling:
                continue
            n = seq.num_tokens - seq.num_cached
            if chunked:
                n = min(n, budget)
                if n <= 0:
                    break
                budget -= n
            plan.work.append(RowWork(seq, seq.num_cached, seq.num_cached + n, seq.num_cached + n == seq.num_tokens))
        self._computed(plan.work)  # the pages these rows fill are found by requests admitted below
        budget += reserve
        # 3. Admission: the oldest waiting requests that fit.
        # Requests past the admission point (the batch is full, admission is held, the step's budget
        # is spent or the next request waits for pages) are still looked at, up to `adapter_lookahead`
        # of them, to start their adapter loads: a load then overlaps the running batch instead of
        # starting only when a place frees up (with one adapter per request, that made the load
        # latency, not the device, set the rate).
        lookahead = max(want, self.adapter_lookahead) if hold else self.adapter_lookahead
        load_only = hold
        looked = 0
        admitted_any = False
        for seq in list(self.waiting):
            if not load_only and len(self.running) >= self.max_batch_size:
                load_only = True
            if not load_only and ((chunked and budget <= 0) or (not chunked and admitted_any and seq.num_tokens > budget)):
                load_only = True
            if load_only:
                if looked >= lookahead:
                    break
                looked += 1
            n = seq.num_tokens
            if n >= self.max_model_len:
                self._fail(seq, plan, f"prompt of {n} tokens does not fit the model's {self.max_model_len}-token context")
                continue
            if self.blocks.pages_for(n + 1) > self.blocks.num_pages:
                if seq.output_ids:  # back after an eviction, grown as long as this runner's whole KV cache
                    self._end(seq, plan, "length")
                else:
                    self._fail(seq, plan, f"request needs {n + 1} KV tokens; this runner holds {self.blocks.total_tokens}")
                continue
            if seq.adapter is not None and seq.slot < 0:
                if self.adapters is None:
                    self._fail(seq, plan, f"adapter {seq.adapter.name!r}: LoRA is disabled on this runner")
                    continue
                try:
                    status, slot = self.adapters.acquire(seq.adapter)
                except AdapterError as exc:
                    self._fail(seq, plan, str(exc))
                    continue
                if status != READY:
                    continue  # loading: later requests may go ahead, this one waits outside the batch
                seq.slot = slot
            if load_only:
                continue
            cached = self._match_prefix(seq, n)
            if self.blocks.pages_for(n + 1) - len(seq.pages) > self.blocks.free_pages:
                self.blocks.release(seq.pages)
                load_only = True  # FCFS: nothing overtakes a request that waits for pages
                continue
            self.blocks.grow(seq.pages, n)
            if seq.cached_tokens is None:  # its first admission here: what the API reports as cached
                seq.cached_tokens = min(cached, len(seq.prompt_ids))
                if self.blocks.caching:  # with the cache off nothing is looked up: no query, no hit
                    self.blocks.stats["queries"] += len(seq.prompt_ids)
                    self.blocks.stats["hits"] += seq.cached_tokens
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            first = min(n - cached, budget) if chunked else n - cached
            plan.work.append(RowWork(seq, cached, cached + first, cached + first == n))
            self._computed(plan.work[-1:])
            budget -= first
            admitted_any = True
        return plan

    def _reserve(self, budget: int, free: int) -> int:
        """Prompt rows of this step kept from the chunks of running prompts for admissions: at most half the
        budget, at most the prompts of the first `free` waiting requests, and none while a request part-way through
        its prompt has none to share with (no prefill in progress) or the next waiting request cannot be admitted
        now (its adapter still loading, or its prompt larger than the free pages: FCFS, nothing overtakes it), or
        shares its first page with a prompt still being computed (with the prefix cache it would compute again what
        that prompt is about to cache)."""
        if free <= 0 or not self.waiting or not any(s.prefilling for s in self.running):
            return 0
        head = self.waiting[0]
        if head.adapter is not None and head.slot < 0 and (self.adapters is None
                                                         or not self.adapters.is_resident(head.adapter)):
            return 0
        if self.blocks.pages_for(head.num_tokens + 1) > self.blocks.free_pages:
            return 0
        ps = self.blocks.page_size
        if self.blocks.caching and head.num_tokens > ps and any(
                s.prefilling and s.adapter == head.adapter and s.cache_salt == head.cache_salt
                and s.prompt_ids[:ps] == head.prompt_ids[:ps] for s in self.running):
            return 0  # it shares its first page with a prompt still being computed: it finds it cached if it waits
        want = sum(s.num_tokens for s in itertools.islice(self.waiting, free))
        return min(budget // 2, want)

    def _computed(self, work: list[RowWork]) -> None:
        """Host bookkeeping: these rows' K/V are written by this step (before any later step reads them, and
        in each layer before this step's attention reads any: a request admitted later in the same step may
        share the full pages they complete; with reuse_next_step, only the requests of later steps)."""
        for w in work:
            w.seq.num_cached = w.end
            if self.blocks.caching:
                if self.reuse_next_step:
                    self._unregistered.append(w.seq)
                else:
                    self._register(w.seq)

    # -- the prefix cache -------------------------------------------------------------------------------
    def _keys(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """The keys of the full pages among the first `num_tokens` known tokens (extended as they come)."""
        root = key_root(self.identity(seq), seq.cache_salt)
        if seq.key_root != root:
            seq.key_root, seq.page_keys = root, []
        ps = self.blocks.page_size
        have = len(seq.page_keys)
        if (num_tokens // ps) > have:
            seq.page_keys = chain_keys(root, seq.all_ids[: num_tokens // ps * ps], ps, have, seq.page_keys)
        return seq.page_keys[: num_tokens // ps]

    def _match_prefix(self, seq: Sequence, n: int) -> int:
        """Admission: take the cached pages of the longest cached run of the request's full pages, leaving
        at least its last token to compute; the tokens covered. None for a request that asks for its prompt's
        log-probabilities: those come from computing every position."""
        if not self.blocks.caching or seq.params.prompt_logprobs is not None:
            return 0
        pages = self.blocks.match(self._keys(seq, n - 1))
        seq.pages[:] = pages
        seq.num_registered = len(pages)
        return len(pages) * self.blocks.page_size

    def _register(self, seq: Sequence) -> None:
        """Cache the request's full pages whose K/V this step computes and whose tokens are all known."""
        known = min(seq.num_cached, len(seq.prompt_ids) + len(seq.output_ids))
        full = known // self.blocks.page_size
        if full > seq.num_registered:
            self.blocks.register(seq.pages, self._keys(seq, full * self.blocks.page_size), seq.num_registered)
            seq.num_registered = full

    def _evict(self, seq: Sequence, plan: StepPlan) -> None:
        self.remove(seq)
        seq.finish_reason = "evicted"
        plan.work = [w for w in plan.work if w.seq is not seq]
        plan.evicted.append(seq)

    def _end(self, seq: Sequence, plan: StepPlan, reason: str) -> None:
        """Finish a request here with `reason` and the tokens it has (no error)."""
        self.remove(seq)
        seq.finish_reason = reason
        plan.failed.append(seq)

    def _fail(self, seq: Sequence, plan: StepPlan, message: str) -> None:
        self.remove(seq)
        seq.finish_reason, seq.error = "error", message
        plan.failed.append(seq)
