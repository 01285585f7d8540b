"""Cluster scheduling over real runner processes on loopback (CPU, a tiny model).

Busiest-that-fits placement, migration by recompute under a tiny KV pool, kill -9 failover,
drain, FCFS under overload, and page release on client disconnect.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from cluster_helpers import Runner, Scheduler, start_runners
from lorafleet.runner.config import EngineConfig
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.sequence import SamplingParams, Sequence
from lorafleet.scheduler.tokenizer import Tokenizer
from lorafleet.scheduler.placement import default_queue

pytestmark = pytest.mark.timeout(300)


def prompts(n, seed, lo=6, hi=14):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(300, 40000, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def reference(model, ps, max_tokens):
    eng = Engine(str(model), EngineConfig(page_size=4, num_pages=2000, max_batch_size=64))
    seqs = [Sequence(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for i, p in enumerate(ps)]
    out = eng.run_to_completion(seqs)
    tok = Tokenizer(model)
    return [tok.decode(out[f"r{i}"].output_ids) for i in range(len(ps))]


@pytest.fixture(scope="module")
def wide(tiny_chat_llama):
    """Three runners with plenty of KV: the batch limit (4) is what binds."""
    rs = start_runners(tiny_chat_llama, 3, "--max-batch-size", "4", "--page-size", "4", "--kv-pages", "1000")
    yield rs
    for r in rs:
        r.stop()


@pytest.fixture(scope="module")
def tight(tiny_chat_llama):
    """Two runners with a tiny KV pool (160 tokens each): long generations must be evicted."""
    rs = start_runners(tiny_chat_llama, 2, "--max-batch-size", "8", "--page-size", "4", "--kv-pages", "40")
    yield rs
    for r in rs:
        r.stop()


async def wait_for(cond, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        v = await cond()
        if v:
            return v
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_consolidation_fills_busiest_runner_first(tiny_chat_llama, wide):
    async with Scheduler(tiny_chat_llama, wide) as s:
        tasks = []
        cap = 4 + default_queue(4)  # max batch 4 plus the default queue allowance (1)
        expected = [{"runner-2": k} for k in range(1, cap + 1)] + [{"runner-2": cap, "runner-1": 1},
                                                                    {"runner-2": cap, "runner-1": 2}]
        for i, want in enumerate(expected):
            tasks.append(asyncio.create_task(s.stream_tokens(prompts(1, i)[0], 400)))

            async def placed():
                b = await s.batches()
                return b if sum(b.values()) == i + 1 else None

            b = await wait_for(placed)
            assert {k: v for k, v in b.items() if v} == want, b
        assert (await s.batches())["runner-0"] == 0  # the idle runner stays idle
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_migration_under_tiny_kv_pool(tiny_chat_llama, tight):
    ps = prompts(6, 10)
    want = reference(tiny_chat_llama, ps, 120)
    async with Scheduler(tiny_chat_llama, tight) as s:
        records = [[] for _ in ps]
        got = await asyncio.gather(*(s.stream_tokens(p, 120, record=rec) for p, rec in zip(ps, records)))
        migrations = s.service.metrics.migrations._value.get()
    assert migrations > 0, "the tiny KV pool should have forced evictions"
    assert got == want  # nothing lost, nothing repeated, same greedy tokens
    for r in tight:
        st = r.state()
        assert st["free_kv_tokens"] == st["total_kv_tokens"]


async def test_a_request_that_outgrows_every_runners_kv_cache_ends_at_length(tiny_chat_llama, tight):
    """Prompt + output larger than any runner's whole KV pool (160 tokens): evicted when its runner is full,
    it cannot be placed again, so it ends with finish_reason "length" and the tokens it has (the greedy
    tokens of a run without limits), instead of waiting in the queue for ever."""
    import json

    p = prompts(1, 40)[0]
    want = reference(tiny_chat_llama, [p], 300)[0]
    async with Scheduler(tiny_chat_llama, tight) as s:
        body = {"model": "tiny", "prompt": p, "max_tokens": 300, "temperature": 0, "ignore_eos": True}
        resp = await asyncio.wait_for(s.client.post("/v1/completions", json=body), 60)
        assert resp.status == 200, await resp.text()
        out = json.loads(await resp.text())
        choice = out["choices"][0]
        assert choice["finish_reason"] == "length"
        assert 100 < out["usage"]["completion_tokens"] <= 160 - len(p) + 1  # the last token needs no K/V yet
        assert want.startswith(choice["text"]) and choice["text"]
        assert s.service.metrics.migrations._value.get() >= 1
    for r in tight:
        st = r.state()
        assert st["free_kv_tokens"] == st["total_kv_tokens"]


async def test_fcfs_under_overload(tiny_chat_llama, wide):
    """One runner of batch 4 and 12 requests arriving one by one: they are placed in arrival order."""
    async with Scheduler(tiny_chat_llama, wide[:1]) as s:
        ps = prompts(12, 20)
        index = {tuple(p): i for i, p in enumerate(ps)}
        placed = []
        cluster = s.service.cluster
        run_on = cluster._run_on

        async def recording(runner, req):
            placed.append(index[tuple(req.prompt_ids)])
            return await run_on(runner, req)

        cluster._run_on = recording
        tasks = []
        for p in ps:
            tasks.append(asyncio.create_task(s.stream_tokens(p, 30)))
            await asyncio.sleep(0.01)  # arrival order
        out = await asyncio.gather(*tasks)
    assert all(out)
    assert placed == list(range(12)), placed  # nobody overtook an earlier arrival


async def test_drain_stops_new_work_and_reports_empty(tiny_chat_llama, wide):
    async with Scheduler(tiny_chat_llama, wide) as s:
        r = await s.client.post("/admin/runners/runner-2/drain", headers=s.auth)
        assert (await r.json())["draining"] is True
        outs = await asyncio.gather(*(s.stream_tokens(p, 8) for p in prompts(6, 30)))
        assert all(outs)
        st = {x["id"]: x for x in (await s.state())["runners"]}
        assert st["runner-2"]["draining"] and st["runner-2"]["batch_size"] == 0
        served = {rid: s.service.cluster.runners[rid].state.get("idle_seconds", 0) for rid in st}
        assert served  # state is populated
        r = await s.client.post("/admin/runners/runner-2/drain", headers=s.auth)
        assert (await r.json())["empty"] is True
        # no request was placed on the draining runner: it is still idle in its own view
        assert wide[2].state()["batch_size"] == 0
        r = await s.client.post("/admin/runners/runner-2/undrain", headers=s.auth)
        assert (await r.json())["draining"] is False
        assert (await s.client.post("/admin/runners/nope/drain", headers=s.auth)).status == 404


async def test_client_disconnect_frees_runner_pages(tiny_chat_llama, wide):
    async with Scheduler(tiny_chat_llama, wide[:1]) as s:
        rec = []
        task = asyncio.create_task(s.stream_tokens(prompts(1, 40)[0], 480, record=rec))
        await wait_for(lambda: asyncio.sleep(0, result=bool(rec)))
        assert wide[0].state()["batch_size"] == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

        async def freed():  # (the runner's state read off the event loop: the scheduler's cancel runs on it)
            st = await asyncio.to_thread(wide[0].state)
            return st["batch_size"] == 0 and st["free_kv_tokens"] == st["total_kv_tokens"]

        await wait_for(freed, timeout=5.0)  # a loaded 2-core machine; the 1-second bound is tested in test_serve_e2e


async def test_kill9_runner_requests_complete_elsewhere(tiny_chat_llama, tight):
    ps = prompts(3, 50)
    want = reference(tiny_chat_llama, ps, 60)
    async with Scheduler(tiny_chat_llama, tight) as s:
        records = [[] for _ in ps]
        tasks = [asyncio.create_task(s.stream_tokens(p, 60, record=rec)) for p, rec in zip(ps, records)]
        await wait_for(lambda: asyncio.sleep(0, result=all(records)))
        victim = max(tight, key=lambda r: r.state()["batch_size"])
        assert victim.state()["batch_size"] > 0
        victim.kill9()
        got = await asyncio.gather(*tasks)
        assert s.service.metrics.replacements._value.get() > 0
    assert got == want


async def test_least_loaded_placement_spreads_and_busy_time_is_counted(tiny_chat_llama, wide):
    async with Scheduler(tiny_chat_llama, wide, placement="least-loaded") as s:
        tasks = [asyncio.create_task(s.stream_tokens(p, 400)) for p in prompts(3, 60)]

        async def placed():
            b = await s.batches()
            return b if sum(b.values()) == 3 else None

        assert await wait_for(placed) == {"runner-0": 1, "runner-1": 1, "runner-2": 1}  # one each, unlike busiest
        await asyncio.sleep(0.2)
        busy = {r["id"]: r["busy_seconds"] for r in (await s.state())["runners"]}
        assert all(v > 0 for v in busy.values()), busy
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_scheduler_without_the_runner_credential_sees_no_healthy_runner(tiny_chat_llama, wide):
    async with Scheduler(tiny_chat_llama, wide[:1], runner_token="wrong", wait_healthy=False) as s:
        runner = s.service.cluster.runners["runner-0"]
        await wait_for(lambda: asyncio.sleep(0, result=runner.failures >= 2))  # its polls were refused
        assert not s.service.cluster.any_healthy() and not runner.connected
        r = await s.client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 2})
        assert r.status == 503


async def test_engine_crash_replaces_requests_on_another_runner(tiny_chat_llama):
    """Runner 1's engine core raises in its 6th step: it turns unhealthy with the reason, and its
    in-flight requests finish on runner 0 with exactly the tokens of an uninterrupted run."""
    ps = prompts(3, 70)
    want = reference(tiny_chat_llama, ps, 40)
    good = start_runners(tiny_chat_llama, 1, "--max-batch-size", "8", "--page-size", "4", "--kv-pages", "400")
    bad = [Runner(tiny_chat_llama, "runner-1", "--max-batch-size", "8", "--page-size", "4", "--kv-pages", "400",
                  env={"LORAFLEET_ENGINE_FAULT": "step:6"})]
    bad[0].wait_ready()
    try:
        async with Scheduler(tiny_chat_llama, good + bad) as s:  # busiest-that-fits: ties go to runner-1
            got = await asyncio.gather(*(s.stream_tokens(p, 40) for p in ps))
            assert s.service.metrics.replacements._value.get() >= len(ps)
            st = bad[0].state()
            assert st["engine"]["alive"] is False and "injected engine fault" in st["error"]
            assert not {r["id"]: r for r in (await s.state())["runners"]}["runner-1"]["healthy"]
        assert got == want
    finally:
        for r in good + bad:
            r.stop()
