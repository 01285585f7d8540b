"""Continuous batching: which requests run this step, page allocation and eviction.

Each step: every running request decodes one token (it needs room for one more KV
entry; when pages run out the *newest* running request is evicted, Punica §5.3), then
waiting requests are admitted oldest first while the batch has room, their adapter is
resident and their whole prompt fits in free pages (prefill). Admission is FCFS: a request
that does not fit blocks later ones, except requests merely waiting for an adapter load.

Admission batching (`admit_batch` > 1): while requests run, new ones are admitted only once
`min(admit_batch, waiting)` batch places are free, or after `admit_wait_steps` held steps, so
prompts share mixed prefill+decode steps (which cost more than decode steps) instead of each
taking its own. Adapter loads of the requests next in line start while admission is held.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lorafleet.common.peft_config import AdapterError
from lorafleet.runner.block_manager import BlockManager
from lorafleet.runner.lora.manager import READY, AdapterManager
from lorafleet.runner.sequence import Sequence, Status


@dataclass
class StepPlan:
    prefill: list[Sequence] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    evicted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # finish_reason "error", error set

    @property
    def seqs(self) -> list[Sequence]:
        return self.prefill + self.decode


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
    ):
        if admit_batch < 1 or admit_wait_steps < 0:
            raise ValueError("admit_batch must be >= 1 and admit_wait_steps >= 0")
        self.blocks, self.adapters = blocks, adapters
        self.admit_batch, self.admit_wait_steps = admit_batch, admit_wait_steps
        self._held = 0  # consecutive steps admission was held
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

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
        seq.num_cached = 0
        if seq.slot >= 0 and self.adapters is not None:
            self.adapters.release(seq.slot)
        seq.slot = -1
        seq.status = Status.FINISHED

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        # 1. Decode: each running request needs room for the token it feeds this step.
        for seq in sorted(self.running, key=lambda s: s.age_key):
            if seq.status != Status.RUNNING:
                continue  # evicted below while making room for an older request
            while not self.blocks.grow(seq.pages, seq.num_tokens):
                victim = max((s for s in self.running), key=lambda s: s.age_key)
                self._evict(victim, plan)
                if victim is seq:
                    break
            if seq.status == Status.RUNNING:
                plan.decode.append(seq)
        # 2. Prefill: admit the oldest waiting requests that fit.
        budget = self.max_prefill_tokens
        want = min(self.admit_batch, len(self.waiting))
        free = self.max_batch_size - len(self.running)
        hold = (self.admit_batch > 1 and bool(self.running) and free < want
                and (free == 0 or self._held < self.admit_wait_steps))
        if not hold:
            self._held = 0
        elif free > 0:
            self._held += 1  # a full batch admits nobody anyway: only count steps with free places
        looked = 0
        for seq in list(self.waiting):
            if hold:
                if looked >= want:
                    break
                looked += 1  # held: only start the adapter loads of the next requests in line
            elif len(self.running) >= self.max_batch_size:
                break
            n = seq.num_tokens
            if n >= self.max_model_len:
                self._fail(seq, plan, f"prompt of {n} tokens does not fit the model's {self.max_model_len}-token context")
                continue
            if self.blocks.pages_for(n + 1) > self.blocks.num_pages:
                self._fail(seq, plan, f"request needs {n + 1} KV tokens; this runner holds {self.blocks.total_tokens}")
                continue
            if plan.prefill and n > budget:
                break
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
            if hold:
                continue
            if self.blocks.pages_for(n + 1) > self.blocks.free_pages:
                break  # FCFS: nothing overtakes a request that waits for pages
            self.blocks.grow(seq.pages, n)
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.prefill.append(seq)
            budget -= n
        return plan

    def _evict(self, seq: Sequence, plan: StepPlan) -> None:
        self.remove(seq)
        seq.finish_reason = "evicted"
        if seq in plan.decode:
            plan.decode.remove(seq)
        plan.evicted.append(seq)

    def _fail(self, seq: Sequence, plan: StepPlan, message: str) -> None:
        self.remove(seq)
        seq.finish_reason, seq.error = "error", message
        plan.failed.append(seq)
