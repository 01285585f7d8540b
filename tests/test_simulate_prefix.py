"""`lorafleet simulate` with the prefix cache: the GPUs' page caches behave as a runner's, conversations resend
their history, and prefix-aware placement finds more of it than placement that ignores prefixes, on as many
GPU-hours."""

from __future__ import annotations

import pytest

from lorafleet.scheduler import simulate as sim

MODEL = sim.StepModel(decode_base_ms=6.3, decode_per_req_ms=0.13, prefill_per_token_ms=0.009)


def run(policy, workload="chat", system_prompt=256, duration=300.0):
    if workload == "chat":
        trace = sim.chat_trace(duration, 30.0, 1, 50, system_prompt, 4, 10.0, 4096)
    else:
        trace = sim.diurnal_trace(duration, 30.0, 1, 50)
    return sim.simulate(trace, policy, gpus=8, max_batch=16, kv_tokens=100_000, model=MODEL, idle_window=30.0)


def test_page_cache_keeps_held_pages_and_drops_the_least_recent_others():
    c = sim.PageCache()
    c.hold(["a0", "a1", "a2"])
    c.trim(2)  # a running request's pages are never dropped
    assert c.match(["a0", "a1", "a2", "a3"]) == 3
    c.release(["a0", "a1", "a2"], ["a0", "a1", "a2", "a3"])  # it leaves with its answer's page a3
    c.hold(["b0"])
    c.trim(4)  # 5 pages, room for 4: the oldest unheld one goes, which is a3 (a page table is freed from its end)
    assert c.match(["a0", "a1", "a2", "a3"]) == 3 and c.match(["b0"]) == 1
    c.trim(2)
    assert c.match(["a0", "a1"]) == 1 and c.match(["b0"]) == 1
    c.clear()
    assert c.match(["a0"]) == 0 and c.match(["b0"]) == 0


def test_a_turn_resends_the_system_prompt_and_the_history_under_the_same_page_keys():
    conv = sim.Conversation(7, adapter=3, system_prompt=64, turns=[(20, 30), (40, 10)], think_s=[1.0, 1.0])
    first = sim.turn_request(conv, 0, 0.0, None)
    second = sim.turn_request(conv, 1, 5.0, first)
    assert first.prompt == 84 and second.prompt == 84 + 30 + 40
    done = first.keys(first.prompt + first.output - 1)  # what the first turn left cached: prompt and answer
    assert second.keys(second.prompt - 1)[:len(done)] == done
    other = sim.turn_request(sim.Conversation(8, 3, 64, [(20, 30)], [1.0]), 0, 0.0, None)
    assert other.keys(other.prompt - 1)[:4] == done[:4]  # the adapter's system prompt: 4 pages
    assert other.keys(other.prompt - 1)[4:] != done[4:5]  # then another user's text


def test_without_a_cache_every_prompt_token_is_computed():
    res = run("busiest" + sim.NO_CACHE)
    assert res["completed"] == res["requests"] > 500 and not res["prefix_cache"]
    assert res["cached_tokens"] == 0 and res["prefill_tokens_computed"] == res["prompt_tokens"]


def test_prefix_aware_placement_finds_more_history_on_as_few_gpu_hours():
    today = run("busiest-no-prefix" + sim.NO_CACHE, system_prompt=0)
    ignoring = run("busiest-no-prefix", system_prompt=0)
    aware = run("busiest", system_prompt=0)
    assert aware["requests"] == ignoring["requests"] == today["requests"]
    assert aware["hit_rate"] >= 1.5 * ignoring["hit_rate"] > 0
    assert aware["prefill_tokens_computed"] < ignoring["prefill_tokens_computed"] < today["prefill_tokens_computed"]
    assert aware["gpu_hours"] <= 1.05 * today["gpu_hours"] and aware["gpu_hours"] <= 1.05 * ignoring["gpu_hours"]


def test_with_nothing_shared_prefix_awareness_changes_nothing():
    aware, ignoring = run("busiest", "sharegpt"), run("busiest-no-prefix", "sharegpt")
    assert aware["cached_tokens"] == ignoring["cached_tokens"] == 0
    assert {k: aware[k] for k in ("gpu_hours", "ttft_p99_s", "per_gpu_hours")} == {
        k: ignoring[k] for k in ("gpu_hours", "ttft_p99_s", "per_gpu_hours")}


@pytest.mark.parametrize("bad", ["fastest", "least-loaded@16", "busiest@x", "busiest:no-cache:no-cache"])
def test_unknown_policies_are_refused_by_name(bad):
    with pytest.raises(SystemExit, match="policy"):
        run(bad, duration=1.0)
