"""Request priorities (vLLM's convention: lower values first): the scheduler's queue and a runner's admission
take the most important request first and FCFS among equals; a runner out of KV pages evicts the least important
(newest among equals); an API key's `priority` is a floor its requests cannot go below."""

from __future__ import annotations

import pytest

from api_helpers import start, stop
from fake_runner import FakeRunner
from lorafleet.runner.engine.batcher import Batcher
from lorafleet.runner.engine.block_manager import BlockManager
from lorafleet.runner.engine.sequence import SamplingParams, Sequence
from lorafleet.scheduler.api_keys import ApiKeyFileError, ApiKeys, parse_keys


def seq(rid: str, t: float, priority: int = 0, n: int = 8) -> Sequence:
    return Sequence(rid, list(range(1, 1 + n)), SamplingParams(max_tokens=64, ignore_eos=True), None, arrival=t,
                    priority=priority)


def test_a_runner_admits_by_priority_then_arrival():
    b = Batcher(BlockManager(256, 16), None, max_batch_size=2, max_prefill_tokens=4096, max_model_len=1024)
    for s in (seq("late-urgent", 3.0, -5), seq("early", 1.0), seq("mid", 2.0), seq("early-lazy", 0.5, 9)):
        b.add(s)
    assert [w.seq.id for w in b.schedule().work] == ["late-urgent", "early"]  # two places: the most important
    assert [s.id for s in b.waiting] == ["mid", "early-lazy"]


def test_a_runner_out_of_pages_evicts_the_least_important_first():
    b = Batcher(BlockManager(6, 4), None, max_batch_size=4, max_prefill_tokens=4096, max_model_len=1024)
    urgent, lazy = seq("urgent", 2.0, -1, n=7), seq("lazy", 1.0, 3, n=7)
    b.add(urgent)
    b.add(lazy)
    evicted = []
    for _ in range(8):
        plan = b.schedule()
        evicted += [s.id for s in plan.evicted]
        for w in plan.work:
            if w.sample:
                w.seq.output_ids.append(5)
        if evicted:
            break
    assert evicted == ["lazy"]  # though it arrived first


def test_a_keys_priority_is_a_floor():
    keys = parse_keys("low priority=10\nfree\n")
    assert sorted(g.priority for g in keys.values() if g.priority is not None) == [10]
    for bad in ("high", "--5", "1.5", "99999999999"):
        with pytest.raises(ApiKeyFileError, match="priority"):
            parse_keys(f"k priority={bad}")


async def test_the_scheduler_queues_by_priority_and_keys_cannot_jump_it(tok, tmp_path):
    path = tmp_path / "keys"
    path.write_text("low-key priority=10\nany-key\n")
    fr = FakeRunner()
    client, service, servers = await start(tok, [fr], api_keys=ApiKeys(path, reload_s=0.0))
    body = {"model": "base", "prompt": "hi", "max_tokens": 2}
    try:
        auth = {"Authorization": "Bearer low-key"}
        assert (await client.post("/v1/completions", json={**body, "priority": -3}, headers=auth)).status == 200
        assert fr.seen[-1]["priority"] == 10  # its floor, not the -3 it asked for
        assert (await client.post("/v1/completions", json={**body, "priority": 12}, headers=auth)).status == 200
        assert fr.seen[-1]["priority"] == 12  # less important than its floor: allowed
        auth = {"Authorization": "Bearer any-key"}
        assert (await client.post("/v1/completions", json={**body, "priority": -3}, headers=auth)).status == 200
        assert fr.seen[-1]["priority"] == -3
        assert (await client.post("/v1/completions", json=body, headers=auth)).status == 200
        assert "priority" not in fr.seen[-1]  # the default, 0, is not sent
        r = await client.post("/v1/completions", json={**body, "priority": "high"}, headers=auth)
        assert r.status == 400 and (await r.json())["error"]["param"] == "priority"
    finally:
        await stop(client, servers)


def test_the_scheduler_queue_orders_by_priority_then_arrival():
    from lorafleet.scheduler.cluster import Cluster
    from lorafleet.scheduler.request import Request

    c = Cluster.__new__(Cluster)  # (only its queue: no runners, no loop)
    c.queue, c._kick = [], lambda: None
    for rid, t, p in (("a", 1.0, 0), ("b", 2.0, -1), ("c", 0.5, 0), ("d", 3.0, -1), ("e", 0.1, 4)):
        c._enqueue(Request(id=rid, model="m", adapter=None, prompt_ids=[1], max_tokens=1, sampling={}, arrival=t,
                           priority=p))
    assert [r.id for r in c.queue] == ["b", "d", "c", "a", "e"]
