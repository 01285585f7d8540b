"""Placement: busiest-that-fits (Punica §5.1), passing over runners with a long prefill backlog."""

from __future__ import annotations

from lorafleet.scheduler.cluster import RunnerHandle
from lorafleet.scheduler.discovery import RunnerEndpoint
from lorafleet.scheduler.placement import RunnerView, busiest_fit, kv_need
from lorafleet.scheduler.request import Request


def view(rid, batch, backlog=0, free=10_000, max_batch=32, healthy=True, draining=False):
    return RunnerView(rid, healthy, draining, batch, max_batch, free, 10_000, backlog)


def test_busiest_that_fits_is_unchanged_without_backlog():
    rs = [view("a", 3), view("b", 7), view("c", 7), view("d", 32), view("e", 9, free=10)]
    assert busiest_fit(rs, need=100) == "c"  # b/c tie on batch: highest id; d is full; e lacks KV
    assert busiest_fit([view("a", 0, healthy=False), view("b", 1, draining=True)], need=1) is None


def test_long_prefill_backlog_sends_new_work_to_another_runner():
    busy = view("r1", batch=1, backlog=8000)  # an 8,000-token prompt is still being prefilled
    idle = view("r0", batch=0)
    assert busiest_fit([busy, idle], need=kv_need(20, 64), prefill=20) == "r0"
    # short backlogs do not break consolidation: the busiest runner still wins
    assert busiest_fit([view("r1", 5, backlog=300), idle], need=100, prefill=20) == "r1"
    # the threshold is a knob
    assert busiest_fit([view("r1", 5, backlog=300), idle], need=100, prefill=20, max_backlog=256) == "r0"


def test_a_runner_without_backlog_takes_even_a_huge_prompt():
    rs = [view("r0", 2), view("r1", 4, backlog=100)]
    assert busiest_fit(rs, need=9000, prefill=8000) == "r0"


def test_when_every_runner_is_backed_up_the_shortest_backlog_wins():
    rs = [view("r0", 2, backlog=5000), view("r1", 9, backlog=3000), view("r2", 1, backlog=3000)]
    assert busiest_fit(rs, need=10, prefill=10) == "r1"  # shortest backlog; tie: busiest


def test_runner_view_counts_prefill_until_the_first_token():
    h = RunnerHandle(RunnerEndpoint("r0", "http://127.0.0.1:1"))
    h.healthy = True
    h.state = {"total_kv_tokens": 100_000, "max_batch_size": 8, "page_size": 16}
    waiting = Request("a", "m", None, list(range(8000)), max_tokens=10, sampling={})
    running = Request("b", "m", None, list(range(50)), max_tokens=10, sampling={})
    migrated = Request("c", "m", None, list(range(30)), max_tokens=40, sampling={})
    migrated.generated.extend([1] * 12)  # re-placed after an eviction: prompt + generated is recomputed
    for r in (waiting, running, migrated):
        r.runner_id = "r0"
        r.placed_at_generated = len(r.generated)
        h.assigned[r.id] = r
    running.generated.append(7)  # its first token arrived
    v = h.view()
    assert v.prefill_backlog == 8000 + 42 and v.batch_size == 3
    assert h.public_state()["prefill_backlog"] == 8042


def stub_cluster(*specs):
    """A Cluster over in-process runner handles (id, prefix cache on?) whose submits never leave: each placement
    is noted in `placed` as (request id, runner id)."""
    import asyncio
    from types import SimpleNamespace

    from lorafleet.scheduler.cluster import Cluster
    from lorafleet.scheduler.discovery import RunnerDirectory

    cluster = Cluster(RunnerDirectory())
    for rid, enabled in specs:
        h = RunnerHandle(RunnerEndpoint(rid, "http://127.0.0.1:1"))
        h.healthy = True
        h.link = SimpleNamespace(stream_id=f"stream-{rid}", cancel=lambda rid: None)  # its token stream is open
        h.state = {"total_kv_tokens": 100_000, "max_batch_size": 8, "page_size": 16,
                   "prefix_cache": {"enabled": enabled, "queries": 0, "hits": 0}}
        cluster.runners[rid] = h
    placed = []

    async def fake_run(runner, req):
        placed.append((req.id, runner.id))
        await asyncio.sleep(3600)

    cluster._run_on = fake_run
    return cluster, placed


def stop_submits(cluster):
    for h in cluster.runners.values():
        for t in list(h.submits):
            t.cancel()


async def test_cluster_places_past_a_backed_up_runner():
    """Through Cluster.dispatch: the second request avoids the runner still prefilling 8,000 tokens."""
    import asyncio

    cluster, placed = stub_cluster(("r0", False), ("r1", False))
    long = Request("long", "m", None, list(range(8000)), max_tokens=10, sampling={})
    short = Request("short", "m", None, list(range(20)), max_tokens=10, sampling={})
    for r in (long, short):
        cluster.queue.append(r)
    cluster.dispatch()
    await asyncio.sleep(0)
    assert placed == [("long", "r1"), ("short", "r0")]
    stop_submits(cluster)


def test_queue_allowance_lets_a_full_runner_hold_more_and_counts_in_fits():
    from lorafleet.scheduler.placement import RunnerView, busiest_fit, default_queue, fits

    full = RunnerView("a", True, False, batch_size=32, max_batch_size=32, free_kv_tokens=10_000)
    assert not fits(full, 100)  # no allowance: a full batch takes nothing more
    queued = RunnerView("a", True, False, batch_size=32, max_batch_size=32, free_kv_tokens=10_000, queue=8)
    assert fits(queued, 100) and busiest_fit([queued], 100) == "a"
    at_cap = RunnerView("a", True, False, batch_size=40, max_batch_size=32, free_kv_tokens=10_000, queue=8)
    assert not fits(at_cap, 100) and busiest_fit([at_cap], 100) is None
    assert not fits(RunnerView("a", True, False, 33, 32, free_kv_tokens=50, queue=8), 100)  # KV still binds
    assert default_queue(32) == 8 and default_queue(4) == 1 and default_queue(1) == 0


# -- prefix affinity -------------------------------------------------------------------------------------------


def pview(rid, batch, prefix=0, backlog=0, free=10_000):
    return RunnerView(rid, True, False, batch, 32, free, 10_000, backlog, prefix_tokens=prefix)


def test_a_likely_cached_page_counts_as_one_more_request_in_the_batch():
    from lorafleet.scheduler.placement import PREFIX_TOKENS_PER_SLOT

    assert PREFIX_TOKENS_PER_SLOT == 16  # one 16-token page
    # 256 cached tokens are worth 16 places: they beat a runner up to 15 requests busier ...
    assert busiest_fit([pview("a", 4, prefix=256), pview("b", 19)], need=100) == "a"
    # ... but not one 16 busier (a tie of scores goes to the larger batch), nor one busier still
    assert busiest_fit([pview("a", 4, prefix=256), pview("b", 20)], need=100) == "b"
    assert busiest_fit([pview("z", 4, prefix=256), pview("b", 21)], need=100) == "b"
    # a 1,024-token system prompt outweighs any batch that fits: among runners with requests, it decides
    assert busiest_fit([pview("a", 1, prefix=1024), pview("b", 31)], need=100) == "a"
    # between runners alike in load the longer prefix wins, whatever the ids
    assert busiest_fit([pview("z", 7, prefix=16), pview("a", 7, prefix=512)], need=100) == "a"
    # the knob: 0 ignores prefixes (busiest-that-fits as before), a larger value weighs them less
    assert busiest_fit([pview("a", 1, prefix=1024), pview("b", 31)], need=100, prefix_tokens_per_slot=0) == "b"
    assert busiest_fit([pview("a", 6, prefix=1024), pview("b", 10)], need=100, prefix_tokens_per_slot=256) == "b"
    assert busiest_fit([pview("a", 7, prefix=1024), pview("b", 10)], need=100, prefix_tokens_per_slot=256) == "a"


def test_an_empty_runner_gets_no_prefix_credit_so_idle_runners_still_drain():
    assert busiest_fit([pview("a", 0, prefix=4096), pview("b", 1)], need=100) == "b"
    assert busiest_fit([pview("a", 0, prefix=4096), pview("b", 0)], need=100) == "b"  # tie: highest id, as before
    # a runner that does not fit is never chosen for its prefix
    assert busiest_fit([pview("a", 3, prefix=4096, free=10), pview("b", 1)], need=100) == "b"


def test_the_cached_part_of_a_prompt_does_not_count_as_prefill_backlog():
    held = pview("a", 3, prefix=1984, backlog=1500)
    other = pview("b", 1)
    # 2,000 new prompt tokens would push a past the 2,048-token backlog, unless it already holds 1,984 of them
    assert busiest_fit([held, other], need=2100, prefill=2000) == "a"
    assert busiest_fit([pview("a", 3, prefix=0, backlog=1500), other], need=2100, prefill=2000) == "b"


def test_the_no_prefix_policy_is_todays_busiest_that_fits():
    from lorafleet.scheduler.placement import POLICIES

    rs = [pview("a", 6, prefix=4096), pview("b", 10)]
    assert POLICIES["busiest"]()(rs, 100) == "a" and POLICIES["busiest-no-prefix"]()(rs, 100) == "b"


def test_prefix_index_keeps_the_leading_pages_longest_and_forgets_runners():
    from lorafleet.scheduler.prefix_index import PrefixIndex

    idx = PrefixIndex()
    idx.record("r0", ["p0", "p1", "p2"], capacity=4)
    assert idx.match("r0", ["p0", "p1", "p2", "p3"]) == 3 and idx.match("r0", ["p1"]) == 1
    assert idx.match("r0", ["x", "p1"]) == 0  # only a run from the first page counts
    assert idx.match("r1", ["p0"]) == 0
    idx.record("r0", ["q0", "q1"], capacity=4)  # over capacity: the oldest entry goes, a prefix's last page first
    assert idx.match("r0", ["p0", "p1", "p2"]) == 2 and idx.match("r0", ["q0", "q1"]) == 2
    idx.record("r0", ["q0", "q1", "q2"], capacity=4)  # seen again: most recent, and p1 goes before p0
    assert idx.match("r0", ["p0", "p1"]) == 1 and idx.match("r0", ["q0", "q1", "q2"]) == 3
    idx.record("r0", ["q0"] * 10, capacity=100)
    idx.forget("r0")
    assert idx.match("r0", ["q0"]) == 0
    small = PrefixIndex(max_runner_pages=2)
    small.record("r", ["a", "b", "c"], capacity=1000)  # the index's own bound holds whatever the runner has
    assert len(small.pages["r"]) == 2


def test_request_keys_name_adapter_source_salt_and_tokens():
    from lorafleet.scheduler.prefix_index import MAX_PAGES, request_keys
    from lorafleet.scheduler.registry import AdapterEntry

    pirate = AdapterEntry("pirate", "/a/pirate")

    def keys(ids, adapter=None, salt=None, ps=16, generated=()):
        r = Request("x", "m", adapter, list(ids), max_tokens=10, sampling={}, cache_salt=salt)
        r.generated.extend(generated)
        return request_keys(r, ps)

    base = keys(range(50))
    assert len(base) == 3  # full pages before the last token
    assert keys(list(range(48)) + [7, 7, 7, 7])[:3] == base  # same leading pages, same keys
    assert keys(list(range(47)) + [0, 48, 49])[:2] == base[:2] and keys(list(range(47)) + [0, 48, 49])[2] != base[2]
    assert keys(range(50), pirate)[0] != base[0]
    assert keys(range(50), AdapterEntry("pirate", "/a/pirate-v2"))[0] != keys(range(50), pirate)[0]
    assert keys(range(50), salt="s")[0] != base[0] and keys(range(50), salt="s") == keys(range(50), salt="s")
    assert keys(range(50), ps=8)[0] != base[0] and len(keys(range(50), ps=8)) == 6
    # generated tokens extend the chain: the next turn of a chat resends them
    assert keys(range(40), generated=range(40, 50)) == base
    assert len(keys(range(20_000))) == MAX_PAGES


def place(cluster, req, only=None):
    """Dispatch `req`, with every runner but `only` draining for the moment."""
    for h in cluster.runners.values():
        h.draining = only is not None and h.id != only
    cluster.queue.append(req)
    cluster.dispatch()
    for h in cluster.runners.values():
        h.draining = False
    return req.runner_id


SYSTEM = list(range(1000, 1512))  # a 512-token system prompt: two batch places


def chat(i, system=SYSTEM, adapter=None, salt=None):
    return Request(f"q{i}", "m", adapter, system + [5000 + i] * 20, max_tokens=200, sampling={}, cache_salt=salt)


def other(i):
    return Request(f"o{i}", "m", None, [7000 + i] * 30, max_tokens=10, sampling={})


async def test_cluster_sends_a_request_to_the_runner_holding_its_prefix():
    cluster, _ = stub_cluster(("r0", True), ("r1", True))
    try:
        assert place(cluster, chat(0), only="r0") == "r0"  # r0 computed the system prompt
        assert place(cluster, other(1), only="r1") == "r1"
        assert place(cluster, other(2), only="r1") == "r1"
        # r1 is busier (2 against 1) but r0 likely holds 512 tokens of the next request: 1 + 2 places > 2
        v = {x.id: x for x in cluster.views(chat(3))}
        assert v["r0"].prefix_tokens == 512 and v["r1"].prefix_tokens == 0
        assert place(cluster, chat(3)) == "r0"
        # another salt (a tenant of its own), the same tokens under an adapter, or an unrelated prompt: no credit,
        # and busiest-that-fits decides as before (r0 now has 2, r1 has 2: the highest id)
        assert place(cluster, other(4), only="r1") == "r1"
        assert {x.id: x.prefix_tokens for x in cluster.views(chat(5, salt="t"))} == {"r0": 0, "r1": 0}
        from lorafleet.scheduler.registry import AdapterEntry

        assert {x.id: x.prefix_tokens for x in cluster.views(chat(6, adapter=AdapterEntry("p", "/p")))} == {
            "r0": 0, "r1": 0}
        assert place(cluster, chat(7, salt="t")) == "r1"
    finally:
        stop_submits(cluster)


async def test_a_runner_whose_cache_is_off_or_that_failed_gets_no_credit():
    cluster, _ = stub_cluster(("r0", False), ("r1", True))
    try:
        assert place(cluster, chat(0), only="r0") == "r0"
        assert place(cluster, other(1), only="r1") == "r1"
        assert place(cluster, other(2), only="r1") == "r1"
        assert cluster.views(chat(3))[0].prefix_tokens == 0
        assert place(cluster, chat(3)) == "r1"  # busiest: r0's cache is off, so it holds nothing
        # r1 holds the system prompt now; once it fails, what it held is forgotten
        assert {x.id: x.prefix_tokens for x in cluster.views(chat(4))}["r1"] == 512
        cluster._runner_failed(cluster.runners["r1"], "test")
        assert {x.id: x.prefix_tokens for x in cluster.views(chat(4))}["r1"] == 0
        # a restart seen in its counters (a new engine pid) forgets it as well
        cluster.runners["r1"].healthy = True
        place(cluster, chat(5), only="r1")
        assert {x.id: x.prefix_tokens for x in cluster.views(chat(6))}["r1"] == 512
        cluster._count_prefix_cache(cluster.runners["r1"], {"prefix_cache": {"enabled": True, "queries": 5, "hits": 0},
                                                            "engine": {"pid": 1}})
        cluster._count_prefix_cache(cluster.runners["r1"], {"prefix_cache": {"enabled": True, "queries": 9, "hits": 0},
                                                            "engine": {"pid": 1}})
        assert {x.id: x.prefix_tokens for x in cluster.views(chat(6))}["r1"] == 512  # same engine: remembered
        cluster._count_prefix_cache(cluster.runners["r1"], {"prefix_cache": {"enabled": True, "queries": 2, "hits": 0},
                                                            "engine": {"pid": 2}})
        assert {x.id: x.prefix_tokens for x in cluster.views(chat(6))}["r1"] == 0
        assert cluster.prefix_totals["queries"] == 9 + 2
    finally:
        stop_submits(cluster)


async def test_a_finished_turn_is_remembered_with_its_answer_for_the_next_turn():
    cluster, _ = stub_cluster(("r0", True), ("r1", True))
    try:
        first = chat(0)
        assert place(cluster, first, only="r0") == "r0"
        answer = list(range(8000, 8100))
        first.add_tokens(answer)
        cluster._finished(cluster.runners["r0"], first, "length", None)
        nxt = Request("q1", "m", None, first.prompt_ids + answer + [9] * 30, max_tokens=10, sampling={})
        v = {x.id: x.prefix_tokens for x in cluster.views(nxt)}
        assert v == {"r0": (len(first.prompt_ids) + len(answer) - 1) // 16 * 16, "r1": 0}
        # a request migrated away keeps its keys: its new runner is credited once it is placed there
        assert place(cluster, nxt, only="r1") == "r1"
        assert {x.id: x.prefix_tokens for x in cluster.views(chat(2))} == {"r0": 512, "r1": 512}
    finally:
        stop_submits(cluster)
