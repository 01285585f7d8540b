"""Chunked prefill and late arrivals: a short request that arrives while a long prompt is part-way through its
prefill starts in the next step (the running prompt's chunk leaves part of the step's prompt budget to it), not
after that whole prompt; nothing is kept back for a request that cannot be admitted now."""

from __future__ import annotations

from lorafleet.runner.engine.batcher import Batcher
from lorafleet.runner.engine.block_manager import BlockManager
from lorafleet.runner.engine.sequence import SamplingParams, Sequence

STEP = 64  # max_step_tokens


def batcher(pages: int = 256, caching: bool = False) -> Batcher:
    return Batcher(BlockManager(pages, 16, caching=caching), None, max_batch_size=4, max_prefill_tokens=4096,
                   max_model_len=1024, max_step_tokens=STEP)


def req(rid: str, n: int, t: float, first: int = 1) -> Sequence:
    return Sequence(rid, list(range(first, first + n)), SamplingParams(max_tokens=4), None, arrival=t)


def rows(plan) -> dict[str, int]:
    return {w.seq.id: w.end - w.start for w in plan.work}


def test_a_short_request_behind_a_long_prompt_starts_in_the_next_step():
    b = batcher()
    b.add(req("long", 600, 0.0))
    assert rows(b.schedule()) == {"long": STEP}  # alone: the whole budget
    b.add(req("short", 5, 1.0))
    plan = rows(b.schedule())
    assert plan == {"long": STEP - 5, "short": 5}, plan  # admitted at once, the step still full
    plan = rows(b.schedule())
    assert plan == {"short": 1, "long": STEP - 1}, plan  # short decodes; long has the budget back
    # a long arrival: the running prompt keeps half the prompt budget, the newcomer takes the other half
    b.add(req("long2", 300, 2.0))
    plan = rows(b.schedule())
    assert plan == {"short": 1, "long": (STEP - 1) - (STEP - 1) // 2, "long2": (STEP - 1) // 2}, plan


def test_nothing_is_kept_back_for_a_request_that_cannot_be_admitted():
    b = batcher(pages=40)  # 640 KV tokens: the long prompt's 38 pages leave 2
    b.add(req("long", 600, 0.0))
    assert rows(b.schedule()) == {"long": STEP}
    b.add(req("big", 100, 1.0))  # needs 7 pages: waits for the long one to finish (FCFS)
    plan = rows(b.schedule())
    assert plan == {"long": STEP}, plan  # the long prompt's chunk is not cut for it


def test_with_the_prefix_cache_a_request_sharing_the_running_prompt_waits_for_its_pages():
    """The newcomer shares its first pages with the prompt being computed: it is not started beside it (it would
    compute again what that prompt is about to cache) but admitted once those pages are cached, and finds them;
    a newcomer with another prompt starts at once, as without the cache."""
    b = batcher(caching=True)
    b.add(req("long", 300, 0.0))
    assert rows(b.schedule()) == {"long": STEP}
    b.add(req("same", 200, 1.0))  # its 200 tokens are the long prompt's first 200
    plan = rows(b.schedule())
    assert plan == {"long": STEP}, plan
    for _ in range(2):
        b.schedule()
    plan = b.schedule()  # the long prompt has computed 256 of its tokens, past the 200 shared ones
    got = {w.seq.id: (w.start, w.end) for w in plan.work}
    assert got["same"][0] == 192, got  # admitted with its 12 full shared pages found cached
    b2 = batcher(caching=True)
    b2.add(req("long", 300, 0.0))
    b2.schedule()
    b2.add(req("other", 5, 1.0, first=5000))
    assert rows(b2.schedule()) == {"long": STEP - 5, "other": 5}
