"""Adapter lookahead: with the batch full, the batcher starts the adapter loads of the next requests
in line (as many as `adapter_lookahead`), pins those that are ready, and lets go of them on cancel."""

from __future__ import annotations

from lorafleet.runner.engine.batcher import Batcher
from lorafleet.runner.engine.block_manager import BlockManager
from lorafleet.runner.lora.manager import LOADING, READY
from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence, Status


class AsyncAdapters:
    """Loads start on the first acquire and finish when the test says so (as on CUDA)."""

    def __init__(self, loaded=()):
        self.loaded, self.started, self.pins, self.abandoned = set(loaded), [], {}, []

    def acquire(self, ref):
        if ref.name in self.loaded:
            slot = sorted(self.loaded).index(ref.name)
            self.pins[slot] = self.pins.get(slot, 0) + 1
            return READY, slot
        if ref.name not in self.started:
            self.started.append(ref.name)
        return LOADING, -1

    def release(self, slot):
        self.pins[slot] -= 1

    def abandon(self, ref):
        self.abandoned.append(ref.name)

    def finish(self):
        self.loaded |= set(self.started)


def batcher(adapters, lookahead):
    return Batcher(BlockManager(256, 16), adapters, max_batch_size=2, max_prefill_tokens=4096, max_model_len=512,
                   adapter_lookahead=lookahead)


def seqs(n):
    return [Sequence(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4), AdapterRef(f"a{i}", f"/x/a{i}"), arrival=float(i))
            for i in range(n)]


def test_full_batch_starts_the_loads_of_the_next_requests_only_up_to_the_lookahead():
    for lookahead, want in ((0, []), (3, ["a2", "a3", "a4"])):
        ad = AsyncAdapters(loaded={"a0", "a1"})
        b = batcher(ad, lookahead)
        for s in seqs(8):
            b.add(s)
        plan = b.schedule()
        assert [w.seq.id for w in plan.work] == ["r0", "r1"]  # the batch (2) is full
        assert ad.started == want, lookahead


def test_prefetched_adapters_are_pinned_while_waiting_and_released_on_cancel():
    ad = AsyncAdapters(loaded={"a0", "a1"})
    b = batcher(ad, 2)
    reqs = seqs(5)
    for s in reqs:
        b.add(s)
    b.schedule()
    ad.finish()  # a2 and a3 are loaded now
    plan = b.schedule()
    assert plan.work and all(w.decode for w in plan.work)  # nobody admitted: the batch is full
    r2, r3, r4 = reqs[2:]
    assert r2.status == Status.WAITING and r2.slot >= 0 and r3.slot >= 0 and r4.slot < 0
    assert ad.pins[r2.slot] == 1 and ad.pins[r3.slot] == 1
    slot = r2.slot
    b.remove(r2)  # cancelled while waiting: its pin goes
    assert ad.pins[slot] == 0 and r2.slot == -1
    assert ad.started == ["a2", "a3"]
    b.schedule()
    assert ad.started == ["a2", "a3", "a4"]  # r4 moved into the lookahead window
