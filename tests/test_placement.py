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


async def test_cluster_places_past_a_backed_up_runner():
    """Through Cluster.dispatch: the second request avoids the runner still prefilling 8,000 tokens."""
    import asyncio

    from lorafleet.scheduler.cluster import Cluster
    from lorafleet.scheduler.discovery import RunnerDirectory

    from types import SimpleNamespace

    cluster = Cluster(RunnerDirectory())
    for rid in ("r0", "r1"):
        h = RunnerHandle(RunnerEndpoint(rid, "http://127.0.0.1:1"))
        h.healthy = True
        h.link = SimpleNamespace(stream_id=f"stream-{rid}")  # its token stream is open
        h.state = {"total_kv_tokens": 100_000, "max_batch_size": 8, "page_size": 16}
        cluster.runners[rid] = h
    placed = []

    async def fake_run(runner, req):
        placed.append((req.id, runner.id))
        await asyncio.sleep(3600)

    cluster._run_on = fake_run
    long = Request("long", "m", None, list(range(8000)), max_tokens=10, sampling={})
    short = Request("short", "m", None, list(range(20)), max_tokens=10, sampling={})
    for r in (long, short):
        cluster.queue.append(r)
    cluster.dispatch()
    await asyncio.sleep(0)
    assert placed == [("long", "r1"), ("short", "r0")]
    for h in cluster.runners.values():
        for t in list(h.submits):
            t.cancel()


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
